"""What the test files share.

``tiny``: tiny models built from configs (no download), fixed batches, small modules.
``reference``: the float64 references of the method's formulas, one per formula.
``recorders``: dispatch and autograd recorders (shapes produced, tensors saved for backward).
``trl_setup``: the TRL toy task (tokenizer, policy, dataset, reward, trainer configs).
``vllm_helpers``: a real in-process vLLM engine on the toy policy and log-prob readers.
``scripts``: the benchmark scripts, imported as modules or run in a fresh process.
"""
