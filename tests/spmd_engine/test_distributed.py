import pytest

from spmd_engine.distributed import discover_ranks, expand_first_host


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    info = discover_ranks(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port, info.source) == \
        (1, 2, 1, "h", 1234, "torchrun")


def test_slurm_variables():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
           "SLURM_STEP_NODELIST": "node[07-08]", "PATH": ""}
    info = discover_ranks(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == (3, 4, 1, "slurm")
    assert info.master_port == 20000 + 123456 % 20000
    assert info.master_addr in ("node07",)  # no scontrol on PATH: the parser fallback


def test_single_process_default():
    info = discover_ranks({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


@pytest.mark.parametrize("nodelist,first", [
    ("vm", "vm"), ("gpu[003-005,007],cpu01", "gpu003"), ("a-[1,3]", "a-1"), ("n1,n2", "n1")])
def test_nodelist_parser(nodelist, first):
    assert expand_first_host(nodelist) == first
