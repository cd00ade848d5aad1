"""The quick tier (`bash tools/test.sh --quick`): which tests are marked `slow` (tests/conftest.py).

Written by tools/mark_slow.py from a measured run of the whole suite; do not edit SLOW by hand,
measure again. QUICK_DISTRIBUTED is chosen: one distributed test per parallel family, always in
the quick tier.
"""

MEASURED = None

QUICK_DISTRIBUTED = [
    'tests/distributed/test_model_parallel.py::test_tensor_parallel_2_matches_reference',
    'tests/distributed/test_model_parallel.py::test_pipeline_parallel_2_schedule_matches_reference',
    'tests/distributed/test_model_parallel.py::test_context_parallel_2_padded_and_packed_match_reference',
    'tests/distributed/test_step_parallel.py::test_layout_matches_single_process[dp2]',
    'tests/distributed/test_moe_parallel.py::test_expert_layouts_train_like_one_process',
]

SLOW = []
