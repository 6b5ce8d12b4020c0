"""Compare GaLore/APOLLO-Mini (targets only) at projection gap 200 (stored) and 10 (new run)."""
import json, statistics as st, sys
old = json.load(open(sys.argv[1])); new = json.load(open(sys.argv[2]))
def runs(d):
    out = {}
    for r in d["runs"]:
        out.setdefault((r["task"], r["method"], r["value"]), {})[r["seed"]] = r["metrics"]
    return out
o, n = runs(old), runs(new)
# identical warm starts?
same = all(abs(o[k][s]["greedy_before"] - n[k][s]["greedy_before"]) < 1e-12 for k in n for s in n[k] if k in o and s in o[k])
print("warm starts identical (greedy before RL):", same)
for task in ("addition", "sort"):
    for method in ("galore", "apollo-mini"):
        for label, d in (("gap 200", o), ("gap 10", n)):
            settings = {v: d[(task, method, v)] for (t, m, v) in d if t == task and m == method}
            best = max(settings, key=lambda v: st.mean(x["auc"] for x in settings[v].values()))
            aucs = [settings[best][s]["auc"] for s in sorted(settings[best])]
            greedy = [settings[best][s]["greedy_after"] for s in sorted(settings[best])]
            kl = [settings[best][s]["kl_measured"] for s in sorted(settings[best])]
            print(f"{task:8s} {method:11s} {label:7s} best lr {best:g}: AUC {st.mean(aucs):.3f} ± {st.stdev(aucs):.3f}  greedy {st.mean(greedy):.3f}  KL {st.mean(kl):.1e}  per-lr AUC "
                  + ", ".join(f"{v:g}:{st.mean(x['auc'] for x in settings[v].values()):.3f}" for v in sorted(settings)))
        # paired by seed at each one's best
        def best_of(d):
            settings = {v: d[(task, method, v)] for (t, m, v) in d if t == task and m == method}
            b = max(settings, key=lambda v: st.mean(x["auc"] for x in settings[v].values()))
            return settings[b]
        bo, bn = best_of(o), best_of(n)
        diffs = [bn[s]["auc"] - bo[s]["auc"] for s in sorted(bn)]
        gd = [bn[s]["greedy_after"] - bo[s]["greedy_after"] for s in sorted(bn)]
        se = lambda x: st.stdev(x) / len(x) ** 0.5
        print(f"   gap 10 − gap 200, paired by seed: AUC {st.mean(diffs):+.3f} ± {se(diffs):.3f}, greedy {st.mean(gd):+.3f} ± {se(gd):.3f}")
if len(sys.argv) > 3:
    lg = runs(json.load(open(sys.argv[3])))
    for task in ("addition", "sort"):
        settings = {v: lg[(t, m, v)] for (t, m, v) in lg if t == task and m == "logra"}
        b = max(settings, key=lambda v: st.mean(x["auc"] for x in settings[v].values()))
        ref = settings[b]
        same = all(abs(ref[s]["greedy_before"] - n[(task, "galore", 0.003)][s]["greedy_before"]) < 1e-12 for s in ref)
        print(task, "LoGRA defaults best", b, "AUC", f"{st.mean(x['auc'] for x in ref.values()):.3f}", "same warm starts:", same)
        for method in ("galore", "apollo-mini"):
            settings = {v: n[(t, m, v)] for (t, m, v) in n if t == task and m == method}
            bb = max(settings, key=lambda v: st.mean(x["auc"] for x in settings[v].values()))
            d = [settings[bb][s]["auc"] - ref[s]["auc"] for s in sorted(ref)]
            g = [settings[bb][s]["greedy_after"] - ref[s]["greedy_after"] for s in sorted(ref)]
            se = lambda x: st.stdev(x) / len(x) ** 0.5
            print(f"   {method} gap 10 − LoGRA: AUC {st.mean(d):+.3f} ± {se(d):.3f}, greedy {st.mean(g):+.3f} ± {se(g):.3f}")
