"""GaLore and APOLLO-Mini on LoGRA's targets at projection gap 200 (the stored race) against gap 10
(this folder's run), and optionally against LoGRA: best of each sweep, differences paired by seed.

    python compare.py GAP200/learning.json GAP10/learning.json [LOGRA/learning.json]
"""

import json
import statistics
import sys


def runs(path: str) -> dict:
    """``{(task, method, setting): {seed: metrics}}`` of a bench_learning.py learning.json."""
    found = {}
    for run in json.load(open(path))["runs"]:
        found.setdefault((run["task"], run["method"], run["value"]), {})[run["seed"]] = run["metrics"]
    return found


def best(found: dict, task: str, method: str) -> tuple[float, dict]:
    """The setting with the highest mean AUC over seeds, and its runs."""
    settings = {value: seeds for (t, m, value), seeds in found.items() if t == task and m == method}
    value = max(settings, key=lambda v: statistics.mean(x["auc"] for x in settings[v].values()))
    return value, settings[value]


def paired(a: dict, b: dict, key: str) -> str:
    """Mean ± standard error over seeds of ``a − b``."""
    differences = [a[seed][key] - b[seed][key] for seed in sorted(a)]
    error = statistics.stdev(differences) / len(differences) ** 0.5
    return f"{statistics.mean(differences):+.3f} ± {error:.3f}"


def main(old_path: str, new_path: str, logra_path: str | None = None) -> None:
    old, new = runs(old_path), runs(new_path)
    same = all(old[key][seed]["greedy_before"] == new[key][seed]["greedy_before"] for key in new for seed in new[key])
    print("warm starts identical (greedy before RL):", same)
    for task in ("addition", "sort"):
        for method in ("galore", "apollo-mini"):
            for label, found in (("gap 200", old), ("gap 10", new)):
                value, seeds = best(found, task, method)
                auc = [seeds[s]["auc"] for s in sorted(seeds)]
                greedy = statistics.mean(seeds[s]["greedy_after"] for s in seeds)
                print(
                    f"{task:8s} {method:11s} {label:7s} best lr {value:g}: AUC {statistics.mean(auc):.3f} ± "
                    f"{statistics.stdev(auc):.3f}  greedy {greedy:.3f}"
                )
            (_, fresh), (_, stored) = best(new, task, method), best(old, task, method)
            auc, greedy = paired(fresh, stored, "auc"), paired(fresh, stored, "greedy_after")
            print(f"   gap 10 − gap 200, paired: AUC {auc}, greedy {greedy}")
    if logra_path is None:
        return
    logra = runs(logra_path)
    for task in ("addition", "sort"):
        value, reference = best(logra, task, "logra")
        print(task, f"LoGRA best budget {value:g}, AUC {statistics.mean(x['auc'] for x in reference.values()):.3f}")
        for method in ("galore", "apollo-mini"):
            for label, found in (("gap 200", old), ("gap 10", new)):
                _, seeds = best(found, task, method)
                auc, greedy = paired(seeds, reference, "auc"), paired(seeds, reference, "greedy_after")
                print(f"   {method} {label} − LoGRA: AUC {auc}, greedy {greedy}")


if __name__ == "__main__":
    main(*sys.argv[1:])
