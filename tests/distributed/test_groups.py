"""The entry points' process groups: one collective timeout for all of them
(trainer.timeout_minutes), and the layout fields the model is built for."""
import datetime

import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = pytest.mark.distributed


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _entry_point_worker(rank, world, timeout_minutes):
    """What train/score/export do: the default group and Megatron-Core's, from a layout."""
    hide_gpus()
    import torch.distributed as dist

    from megatron_rlcorr.parallel.layout import ParallelSettings
    from megatron_rlcorr.runtime import process_groups

    dist.destroy_process_group()  # the harness's own group; process_groups makes the run's
    with process_groups(ParallelSettings(tp=2, sequence_parallel=True), timeout_minutes=timeout_minutes) as groups:
        default = dist.distributed_c10d._get_default_group()
        timeouts = {name: _timeout(getattr(groups, name)) for name in ("tp", "pp", "cp", "dp", "dp_cp")}
        timeouts["default"] = _timeout(default)
        return dict(timeouts=timeouts, sequence_parallel=groups.sequence_parallel, tp=groups.tp_size)


def test_every_group_gets_the_trainer_timeout():
    """Torch's default is 10 minutes and Megatron-Core's 30: a 20k-token generation on one rank
    would time the others out in their next collective."""
    results = run_distributed(_entry_point_worker, 2, 75)
    for result in results:
        assert result["tp"] == 2 and result["sequence_parallel"] is True
        assert set(result["timeouts"].values()) == {datetime.timedelta(minutes=75)}, result["timeouts"]


def test_timeout_minutes_defaults_to_an_hour_and_is_checked():
    from megatron_rlcorr.rl.settings import TrainerSettings

    assert TrainerSettings().timeout_minutes == 60
    with pytest.raises(ValueError, match="timeout_minutes must be >= 1"):
        TrainerSettings(timeout_minutes=0)
