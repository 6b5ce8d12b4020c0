"""``patch_model`` / ``unpatch_model``: target selection, invisibility to checkpoints and loaders,
and compatibility with the ways HF models are actually run (checkpointing, autocast, bf16, eval,
generate)."""

from __future__ import annotations

import copy
import functools
import gc
import re
import warnings

import pytest
import torch
import torch.nn as nn

from logra_optim import LoGRAOptimizer, find_target_modules, patch_model, patched_modules, unpatch_model
from tests.helpers.recorders import OutputShapes
from tests.helpers.tiny import OneLinear, TwoLinear, fixed_batch, sketches, tiny_qwen2

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def expected_names(layers=2, kinds=PROJ):
    parent = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    return {f"model.layers.{i}.{parent.get(p, 'mlp')}.{p}" for i in range(layers) for p in kinds}


def train_sketches(model, batch, rank=4, **kwargs):
    """Bind an optimizer, run one training forward/backward, return the sketches."""
    _optimizer = LoGRAOptimizer(model, rank=rank, lr=1.0, **kwargs)
    model.train()
    model(**batch).loss.backward()
    return sketches(model)


def enable_checkpointing(model, use_reentrant):
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def requires_grad_flags(model):
    return {name: p.requires_grad for name, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------
# Target selection


def test_default_targets_are_the_attention_and_mlp_projections(tiny):
    patch_model(tiny)
    names = {name for name, _ in patched_modules(tiny)}
    assert names == expected_names()
    # Nothing else is a target, and every parameter but the target weights is frozen.
    assert all(not p.requires_grad for p in tiny.parameters())
    assert not hasattr(tiny.lm_head, "_logra")


@pytest.mark.parametrize(
    "selection, expected",
    [
        (["q_proj", "v_proj"], expected_names(kinds=("q_proj", "v_proj"))),
        (["model.layers.1.mlp.down_proj"], {"model.layers.1.mlp.down_proj"}),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj", expected_names(kinds=("gate_proj", "up_proj"))),
        (r".*\.0\.self_attn\..*", {n for n in expected_names() if re.fullmatch(r".*\.0\.self_attn\..*", n)}),
        ("all-linear", expected_names()),  # lm_head, the output embedding, excluded as in peft
        (("k_proj",), expected_names(kinds=("k_proj",))),  # any iterable of names
    ],
)
def test_target_selection(tiny, selection, expected):
    assert {name for name, _ in find_target_modules(tiny, selection)} == expected
    patch_model(tiny, target_modules=selection)
    assert {name for name, _ in patched_modules(tiny)} == expected


def test_list_names_match_whole_components_only(tiny):
    # "proj" is a suffix of every target's last component, but not a component itself.
    with pytest.raises(ValueError, match="no LoGRA target modules found"):
        find_target_modules(tiny, ["proj"])


def test_a_listed_name_that_matches_nothing_is_named_in_a_warning(tiny):
    """A misspelled name beside a good one would otherwise leave the layers it meant frozen, silently."""
    with pytest.warns(RuntimeWarning, match=r"names \['qproj'\] match no module") as caught:
        patch_model(tiny, target_modules=["q_proj", "qproj"])
    assert {name.rsplit(".", 1)[-1] for name, _ in patched_modules(tiny)} == {"q_proj"}
    assert [w.filename for w in caught] == [__file__]


def test_a_string_that_matches_nothing_says_it_is_a_regular_expression(tiny):
    with pytest.raises(ValueError, match=r"A string is a regular expression .* a list of names"):
        patch_model(tiny, target_modules="q_proj")
    assert {name for name, _ in find_target_modules(tiny, r".*\.q_proj")} == {
        f"model.layers.{i}.self_attn.q_proj" for i in range(2)
    }


def test_all_linear_includes_linears_outside_the_default_names():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(4, 4)
            self.q_proj = nn.Linear(4, 4)

    model = Odd()
    assert {n for n, _ in find_target_modules(model)} == {"q_proj"}
    assert {n for n, _ in find_target_modules(model, "all-linear")} == {"encoder", "q_proj"}


def test_no_targets_lists_the_linear_modules_seen(tiny):
    with pytest.raises(
        ValueError, match=r"no LoGRA target modules found.*model\.layers\.0\.self_attn\.q_proj.*lm_head"
    ):
        patch_model(tiny, target_modules=["attention"])
    with pytest.raises(ValueError, match="Linear modules in the model: none"):
        patch_model(nn.Sequential(nn.ReLU()))
    # Nothing was half-patched by the failed calls.
    assert patched_modules(tiny) == [] and not hasattr(tiny, "_logra_patch")
    assert all(p.requires_grad for p in tiny.parameters())


@pytest.mark.parametrize("bad", [[], [3], ""])
def test_invalid_target_modules_argument(tiny, bad):
    with pytest.raises(ValueError, match="target_modules"):
        patch_model(tiny, target_modules=bad)


def test_non_iterable_target_modules_names_the_parameter(tiny):
    with pytest.raises((ValueError, TypeError), match="target_modules"):
        patch_model(tiny, target_modules=5)


def test_gpt2_conv1d_is_rejected_by_name():
    from transformers.pytorch_utils import Conv1D

    class GPT2Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = Conv1D(24, 8)
            self.q_proj = nn.Linear(8, 8)

    block = GPT2Block()
    with pytest.raises(ValueError, match=r"'c_attn' is a GPT-2 Conv1D"):
        patch_model(block, target_modules=["c_attn", "q_proj"])
    with pytest.raises(ValueError, match=r"'c_attn' is a GPT-2 Conv1D"):
        patch_model(block, target_modules=r"c_.*")
    assert patched_modules(block) == []

    class OnlyConv1D(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = Conv1D(16, 8)

    with pytest.raises(ValueError, match="GPT-2 Conv1D layers, which are not supported"):
        patch_model(OnlyConv1D())
    with pytest.raises(ValueError, match="GPT-2 Conv1D layers, which are not supported"):
        patch_model(OnlyConv1D(), target_modules="all-linear")


def test_patch_model_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        patch_model([nn.Linear(2, 2)])


def test_quantized_and_hooked_linears_are_refused_without_changing_the_model():
    quantized = OneLinear(6, 5)
    quantized.proj.weight = nn.Parameter(torch.zeros(5, 6, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match=r"'proj' .* torch.int8 weight: quantized"):
        patch_model(quantized, target_modules=["proj"])
    assert not hasattr(quantized, "_logra_patch") and not hasattr(quantized.proj, "_logra")

    hooked = OneLinear(6, 5)
    original = hooked.proj.forward
    hooked.proj.forward = lambda x: original(x)  # what accelerate's device_map hooks do
    flags = {n: p.requires_grad for n, p in hooked.named_parameters()}
    with pytest.raises(ValueError, match=r"'proj' already has an instance-level forward"):
        patch_model(hooked, target_modules=["proj"])
    assert {n: p.requires_grad for n, p in hooked.named_parameters()} == flags


def test_linears_whose_weight_or_forward_logra_cannot_take_over_are_refused_or_left_out():
    """fp8 weights are quantized linears too; an nn.Linear subclass with a forward of its own would
    have it replaced (its output changed); two targets sharing one weight would be merged twice; and
    nn.MultiheadAttention reads its out_proj's weight without calling it, so that one is left out,
    with a warning, instead of being frozen where no sketch sees its gradient."""
    fp8 = OneLinear(6, 5)
    fp8.proj.weight = nn.Parameter(fp8.proj.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=r"'proj' .* torch.float8_e4m3fn weight: quantized"):
        patch_model(fp8, target_modules=["proj"])

    class Halved(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    model = nn.Sequential(nn.Linear(4, 4))
    model.append(Halved(4, 4))
    with pytest.raises(ValueError, match=r"target module '1' is a Halved, an nn.Linear subclass with a forward"):
        patch_model(model, target_modules=["0", "1"])  # named: refused
    assert not hasattr(model, "_logra_patch") and all(p.requires_grad for p in model.parameters())
    with pytest.warns(RuntimeWarning, match=r"1 left out of LoGRA's targets.*subclass with a forward of its own"):
        patch_model(model, target_modules="all-linear")  # swept up (a router under "all-linear"): left out
    assert [name for name, _ in patched_modules(model)] == ["0"]
    # Falcon's linears subclass nn.Linear with a forward that is a plain linear: targets as usual.
    from transformers import FalconConfig, FalconForCausalLM

    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
    assert [name.rsplit(".", 1)[-1] for name, _ in patched_modules(patch_model(falcon))] == [
        "query_key_value",
        "dense",
        "dense_h_to_4h",
        "dense_4h_to_h",
    ]

    tied = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"target modules '0' and '2' share one weight tensor"):
        patch_model(tied, target_modules="all-linear")
    assert tied[0].weight.requires_grad

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.fc1 = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc1(self.attn(x, x, x)[0])

    model = Attention()
    with pytest.warns(RuntimeWarning, match=r"attn.out_proj left out of LoGRA's targets") as caught:
        patch_model(model)
    assert caught[0].filename == __file__
    assert [name for name, _ in patched_modules(model)] == ["fc1"]


def test_a_transformers_model_without_input_embeddings_is_patched():
    """``get_input_embeddings`` raises ``NotImplementedError`` in a transformers model that has none
    (custom and remote-code models): nothing to hook for checkpointing there."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Regressor(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.up_proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.up_proj(x)

    model = patch_model(Regressor(PretrainedConfig()))
    assert [name for name, _ in patched_modules(model)] == ["up_proj"]


# --------------------------------------------------------------------------------------------------
# Invisible to checkpoints and loaders


def test_state_dict_is_that_of_the_unpatched_model(tiny):
    plain = copy.deepcopy(tiny)
    patch_model(tiny)
    _optimizer = LoGRAOptimizer(tiny, rank=4, lr=1.0)  # binding adds projections and sketches: still invisible
    patched_state, plain_state = tiny.state_dict(), plain.state_dict()
    assert list(patched_state) == list(plain_state)
    assert all(torch.equal(patched_state[k], plain_state[k]) for k in plain_state)
    assert isinstance(tiny.model.layers[0].self_attn.q_proj, nn.Linear)


def test_save_pretrained_loads_in_plain_transformers(tiny, batch, tmp_path):
    from transformers import Qwen2ForCausalLM

    plain = copy.deepcopy(tiny)
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, lr=0.05)
    tiny.train()
    tiny(**batch).loss.backward()
    opt.step()  # so the saved weights are the trained ones, not the initial ones
    tiny.save_pretrained(tmp_path)
    plain.save_pretrained(tmp_path / "plain")

    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path)
    loaded_state, trained_state = loaded.state_dict(), tiny.state_dict()
    assert list(loaded_state) == list(trained_state)
    assert all(torch.equal(loaded_state[k], trained_state[k]) for k in trained_state)
    assert not torch.equal(
        loaded_state["model.layers.0.mlp.up_proj.weight"], plain.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )
    # Same files, same tensor names and config as an unpatched save.
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        p.name for p in (tmp_path / "plain").iterdir() if p.is_file()
    )
    assert patched_modules(loaded) == []


# --------------------------------------------------------------------------------------------------
# Patching twice, unpatching, copying


def test_patching_twice_is_harmless(tiny, batch):
    once = patch_model(copy.deepcopy(tiny))
    twice = patch_model(patch_model(copy.deepcopy(tiny)))
    assert [n for n, _ in patched_modules(twice)] == [n for n, _ in patched_modules(once)]
    assert requires_grad_flags(twice) == requires_grad_flags(once)
    # One sketch contribution per backward, not two.
    s_once, s_twice = train_sketches(once, batch), train_sketches(twice, batch)
    assert all(torch.equal(s_once[k], s_twice[k]) for k in s_once)
    unpatch_model(twice)
    assert requires_grad_flags(twice) == requires_grad_flags(tiny)


def test_patching_again_adds_new_targets_and_unpatch_restores_everything(tiny):
    original = requires_grad_flags(tiny)
    patch_model(tiny, target_modules=["q_proj"])
    tiny.model.norm.weight.requires_grad_(True)  # the user trains a non-target the first call froze
    patch_model(tiny, target_modules=["v_proj"])  # v_proj was frozen as a non-target by the first call
    assert {n for n, _ in patched_modules(tiny)} == expected_names(kinds=("q_proj", "v_proj"))
    assert tiny.model.norm.weight.requires_grad  # the second call leaves flags changed since alone
    unpatch_model(tiny)
    assert requires_grad_flags(tiny) == original


def test_unpatch_restores_forward_and_flags_exactly(tiny, batch):
    # A mix of flags, including a target the user had frozen and a non-target they had trained.
    tiny.model.embed_tokens.weight.requires_grad_(False)
    tiny.model.layers[1].self_attn.k_proj.weight.requires_grad_(False)
    original_flags = requires_grad_flags(tiny)
    embedding_hooks = dict(tiny.model.embed_tokens._forward_hooks)
    tiny.eval()
    with torch.no_grad():
        original_logits = tiny(**batch).logits

    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1.0)
    tiny.train()
    tiny(**batch).loss.backward()
    unpatch_model(tiny)

    assert requires_grad_flags(tiny) == original_flags
    assert patched_modules(tiny) == [] and not hasattr(tiny, "_logra_patch")
    assert all("forward" not in vars(m) and not hasattr(m, "_logra") for m in tiny.modules())
    assert dict(tiny.model.embed_tokens._forward_hooks) == embedding_hooks
    tiny.eval()
    with torch.no_grad():
        assert torch.equal(tiny(**batch).logits, original_logits)
    # Training is dense again: target weights receive ordinary gradients, the old sketches nothing.
    before = [s.clone() for s in opt.sketch_buffers()]
    tiny.train()
    tiny(**batch).loss.backward()
    assert tiny.model.layers[0].mlp.up_proj.weight.grad is not None
    assert all(torch.equal(a, b) for a, b in zip(before, opt.sketch_buffers()))


def test_unpatch_of_an_unpatched_model_is_a_no_op(tiny):
    flags = requires_grad_flags(tiny)
    assert unpatch_model(tiny) is tiny
    assert requires_grad_flags(tiny) == flags


def test_freeze_non_targets_false_leaves_other_flags(tiny):
    patch_model(tiny, freeze_non_targets=False)
    flags = requires_grad_flags(tiny)
    targets = {f"{n}.weight" for n in expected_names()}
    assert all(flags[n] is (n not in targets) for n in flags)


def test_deep_copy_of_a_bound_model_is_unbound():
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=3, lr=1.0)
    twin = copy.deepcopy(model)
    with OutputShapes() as ops:
        twin(**fixed_batch())
    assert not ops.projected_inputs(3)  # the copy does no sketch work for opt
    twin_opt = LoGRAOptimizer(twin, rank=3, lr=1.0)  # not "already driven by another optimizer"
    twin(**fixed_batch()).loss.backward()
    assert any(s.any() for s in twin_opt.sketch_buffers())
    assert all(not s.any() for s in opt.sketch_buffers())


def test_a_deep_copy_does_not_feed_the_optimizers_probe():
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=3, kl_budget=1e-3)
    model(**fixed_batch(seed=1))
    recorded = opt.kl_control.contexts().input_ids.clone()
    twin = copy.deepcopy(model)
    twin(**fixed_batch(seed=2))
    assert torch.equal(opt.kl_control.contexts().input_ids, recorded)
    twin_opt = LoGRAOptimizer(twin, rank=3, kl_budget=1e-3)
    twin(**fixed_batch(seed=2))
    assert torch.equal(opt.kl_control.contexts().input_ids, recorded)
    assert not torch.equal(twin_opt.kl_control.contexts().input_ids, recorded)


def test_a_bound_model_pickles_as_a_patched_unbound_one(batch, tmp_path):
    """``torch.save(model)`` (and multiprocessing) pickle the model: its patched forwards and hooks
    must pickle, and the loaded copy is patched but bound to no optimizer, as a deep copy is."""
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=3, kl_budget=1e-3)
    model(**batch)
    recorded = opt.kl_control.contexts().input_ids.clone()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert [n for n, _ in patched_modules(loaded)] == [n for n, _ in patched_modules(model)]
    loaded.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
    loaded.train()
    with OutputShapes() as ops:
        loaded(**fixed_batch(seed=5))
    assert not ops.projected_inputs(3)  # unbound: no sketch work, nothing recorded for opt
    assert torch.equal(opt.kl_control.contexts().input_ids, recorded)
    loaded_opt = LoGRAOptimizer(loaded, rank=3, lr=1.0)
    loaded(**batch).loss.backward()
    assert any(s.any() for s in loaded_opt.sketch_buffers())
    loaded_opt.step()


# --------------------------------------------------------------------------------------------------
# How models are run


def test_targets_no_gradient_reached_are_named_once(batch):
    """torch's reentrant checkpoint wrapper on one decoder layer: its inputs do not require grad
    (frozen embeddings), so its targets get no gradient. The first update names them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = patch_model(tiny_qwen2())
    first = model.model.layers[0]
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda module: module is first)
    opt = LoGRAOptimizer(model, rank=3, lr=1e-3)
    model.train()
    for update in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**batch).loss.backward()
            opt.step()
        opt.zero_grad()
        named = [str(w.message) for w in caught if "received no gradient" in str(w.message)]
        if update == 0:
            assert len(named) == 1 and "7 of 14 targets" in named[0] and "layers.0." in named[0]
            assert [w.filename for w in caught if "received no gradient" in str(w.message)] == [__file__]
        else:
            assert not named  # once


def test_targets_are_named_when_a_backward_reached_none_of_them(batch):
    """Every decoder layer in a reentrant checkpoint with frozen embeddings: no target gets a
    gradient, while the trainable LM head does. That backward shows in the head's gradient, and the
    first update names all 14 targets."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = patch_model(tiny_qwen2())
    model.lm_head.weight.requires_grad_(True)
    layers = list(model.model.layers)
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda module: module in layers)
    opt = LoGRAOptimizer(model, rank=3, lr=1e-3, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))
    model.train()
    model(**batch).loss.backward()
    with pytest.warns(RuntimeWarning, match="14 of 14 targets ran a training forward but received no gradient"):
        opt.step()


def test_a_forward_without_autograd_is_not_taken_for_an_unreached_target(batch):
    """A train-mode forward under no_grad (generation, a rollout's log-probs) has no backward to
    reach the targets: no warning names them."""
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=3, lr=1e-3)
    model.train()
    with torch.no_grad():
        model(**batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        model(**batch).loss.backward()
        opt.step()
    assert not [w for w in caught if "received no gradient" in str(w.message)]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_sketches(batch, use_reentrant):
    reference = train_sketches(patch_model(tiny_qwen2()), batch)
    model = tiny_qwen2()
    enable_checkpointing(model, use_reentrant)
    patch_model(model)
    checkpointed = train_sketches(model, batch)
    assert all(s.abs().sum() > 0 for s in reference.values())
    for name in reference:
        # Recomputation replays the same forward; only the GEMM grouping may differ.
        torch.testing.assert_close(checkpointed[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_autocast_bf16(batch):
    reference = train_sketches(patch_model(tiny_qwen2()), batch)
    model = patch_model(tiny_qwen2())
    _optimizer = LoGRAOptimizer(model, rank=4, lr=1.0)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    got = sketches(model)
    for name in reference:
        assert got[name].dtype == torch.float32 and torch.isfinite(got[name]).all()
        # A few bf16 roundings (2⁻⁸ each) compounded through two layers: a few percent at most.
        relative = torch.linalg.norm(got[name] - reference[name]) / torch.linalg.norm(reference[name])
        assert relative < 0.05, name
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bf16_weights(batch):
    reference = train_sketches(patch_model(tiny_qwen2()), batch)
    model = patch_model(tiny_qwen2(dtype=torch.bfloat16))
    opt = LoGRAOptimizer(model, rank=4, lr=1e-2)
    model.train()
    model(**batch).loss.backward()
    got = sketches(model)
    for name in reference:
        assert got[name].dtype == torch.float32
        # bf16 weights *and* activations end to end: looser than autocast, still a close match.
        relative = torch.linalg.norm(got[name] - reference[name]) / torch.linalg.norm(reference[name])
        assert relative < 0.1, name
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    opt.step()
    after = model.model.layers[0].mlp.up_proj.weight
    assert after.dtype == torch.bfloat16 and not torch.equal(after, before)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_sketch_work_without_grad(tiny, batch, mode):
    plain = copy.deepcopy(tiny)
    patch_model(tiny)
    _optimizer = LoGRAOptimizer(tiny, rank=3, lr=1.0)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for model in (tiny, plain):
        model.train()  # train mode alone must not trigger sketch work
    with context():
        with OutputShapes() as ops:
            logits = tiny(**batch).logits
        expected = plain(**batch).logits
    assert ops.shapes and not ops.projected_inputs(3)
    assert torch.equal(logits, expected)
    assert all(not s.any() for s in sketches(tiny).values())


def test_no_sketch_work_in_eval_mode(tiny, batch):
    """Eval forwards with grad enabled (e.g. a reference-model pass) must not compute projected
    inputs nor contribute to the sketch; with every weight frozen they build no graph at all, so an
    accidental backward fails loudly instead of silently training nothing."""
    plain = copy.deepcopy(tiny)
    patch_model(tiny)
    _optimizer = LoGRAOptimizer(tiny, rank=3, lr=1.0)
    tiny.eval()
    plain.eval()
    with OutputShapes() as ops:
        loss = tiny(**batch).loss
    assert ops.shapes and not ops.projected_inputs(3)
    assert not loss.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()
    assert torch.equal(loss.detach(), plain(**batch).loss.detach())
    assert all(not s.any() for s in sketches(tiny).values())
    # The same recorder does see the projection in a training forward.
    tiny.train()
    with OutputShapes() as ops:
        tiny(**batch)
    assert len(ops.projected_inputs(3)) >= 14


@pytest.mark.parametrize("train_mode", [False, True])
def test_generate(tiny, batch, train_mode):
    plain = copy.deepcopy(tiny)
    patch_model(tiny)
    _optimizer = LoGRAOptimizer(tiny, rank=4, lr=1.0)
    prompt = batch["input_ids"][:2, :5]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    plain.eval()
    tiny.train(train_mode)
    expected = plain.generate(prompt, **kwargs)
    got = tiny.generate(prompt, **kwargs)
    assert got.shape == (2, 11) and torch.equal(got, expected)
    assert all(not s.any() for s in sketches(tiny).values())


# --------------------------------------------------------------------------------------------------
# Mixture-of-experts models: stacked expert weights are not targets (yet), and are never frozen silently


def _tiny_qwen3_moe():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def test_experts_left_out_are_named_when_frozen_and_can_be_trained_densely():
    model = _tiny_qwen3_moe()
    with pytest.warns(
        UserWarning, match=r"froze 4 stacked expert weights .*'model\.layers\.0\.mlp\.experts\.gate_up_proj'"
    ):
        patch_model(model, experts=False)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    for parameter in experts:  # the remedy the warning names
        parameter.requires_grad_(True)
    before = [p.detach().clone() for p in experts]
    opt = LoGRAOptimizer(model, rank=4, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    model.train()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(experts, before))


def test_a_dense_model_gets_no_expert_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(tiny_qwen2())


def test_adding_targets_under_a_live_optimizer_is_refused():
    """A second ``patch_model`` would freeze the new targets where no optimizer trains them (the
    bound one keeps its own list): refused, naming them. Without new targets it changes nothing; once
    the optimizer is gone, targets can be added and a new optimizer trains them."""
    model = patch_model(TwoLinear(), target_modules=["up"])
    model.down.weight.requires_grad_(True)
    optimizer = LoGRAOptimizer(
        model, rank=3, update_ratio=1e-2, non_target_optimizer=lambda p: torch.optim.SGD(p, lr=0.1)
    )
    with pytest.raises(RuntimeError, match=r"would never train the new targets \['down'\]"):
        patch_model(model, target_modules=["down"])
    assert model.down.weight.requires_grad and not hasattr(model.down, "_logra")
    patch_model(model, target_modules=["up"])  # nothing new
    del optimizer
    gc.collect()
    patch_model(model, target_modules=["down"])
    assert [t.name for t in LoGRAOptimizer(model, rank=3, update_ratio=1e-2).targets] == ["up", "down"]
