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


def _replica_rank(rank: int) -> None:
    """4 ranks as 2 replicas x 2: the plan, the tokens and the TP sums stay inside each replica."""
    import torch

    from spmd_engine.distributed import make_replica
    from spmd_engine.models.parallel import TensorParallel

    replica = make_replica(rank, 4, 2, 2, timeout_s=60)
    assert (replica.index, replica.tp_rank, replica.first_rank, replica.is_leader) == \
        (rank // 2, rank % 2, rank // 2 * 2, rank % 2 == 0)
    plan = replica.broadcast_object(f"plan of replica {replica.index}" if replica.is_leader else None)
    assert plan == f"plan of replica {replica.index}"
    tokens = replica.broadcast_tensor(torch.full((3,), rank if replica.is_leader else -1, dtype=torch.int64))
    assert tokens.tolist() == [replica.first_rank] * 3
    tp = TensorParallel(replica.tp_rank, replica.tp_size, replica.group)
    assert tp.all_reduce(torch.tensor([float(rank)])).item() == 2 * replica.first_rank + 1  # its own two ranks
    gathered = tp.gather_to_first(torch.tensor([[float(rank)]]), dim=1)
    assert (gathered.tolist() if replica.is_leader else gathered) == ([[rank, rank + 1]] if replica.is_leader else None)


@pytest.mark.slow  # 4 spawned processes
def test_replicas_keep_their_collectives_to_their_own_ranks():
    from tests.helpers.spawned_ranks import run_on_ranks

    run_on_ranks(_replica_rank, (), world_size=4, timeout_s=120)


def test_one_replica_uses_the_default_group_and_a_one_rank_replica_none():
    from spmd_engine.distributed import make_replica

    assert make_replica(1, 2, 1, 2) == make_replica(1, 2, 1, 2)  # no group made: the default group
    assert make_replica(1, 2, 1, 2).group is None and make_replica(1, 2, 1, 2).tp_size == 2
    with pytest.raises(ValueError):
        make_replica(0, 4, 3, 1)
