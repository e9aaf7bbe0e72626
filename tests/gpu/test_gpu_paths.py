"""The GPU paths, on real CUDA devices (marker `gpu`: skipped with "needs a GPU" elsewhere).

One GPU: a rank placed with `resources.gpus` sees its GPU and computes there; bf16 compute over
fp32 master weights on CUDA; FSDP2 over a one-rank NCCL group (collectives on the GPU, mixed
precision policy, gradient sync toggling). Two GPUs or more: FSDP2 over NCCL with two ranks, and
the NCCL weight-sync backend (bit-exact stream; a dead receiver dropped while the source lives).
Written against the documented torch.distributed / FSDP2 / Ray APIs; run by tests/gpu/run.sh.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "trainer"))
sys.path.insert(0, str(ROOT / "tests" / "trainer" / "runtime"))


def _gpus() -> int:
    """GPUs of this process. Called inside tests only, never at import: spawned ranks import this
    module, and a CUDA query there would initialise CUDA before the rank picks its device."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need_gpus(n: int) -> None:
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs (NCCL puts one rank per GPU)")


def _rank_device(rank: int) -> str:
    """A spawned rank's GPU, chosen by index (CUDA may already be initialised in the rank, so
    CUDA_VISIBLE_DEVICES set here would be ignored and every rank would land on GPU 0)."""
    torch.cuda.set_device(rank)
    return f"cuda:{rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from trainer_jobs import MODEL

    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model

    ensure_model(ModelSpec(path=str(MODEL), bootstrap="tiny-arithmetic"))
    return MODEL


def test_a_rank_given_gpus_computes_on_its_gpu(tiny_model: Path) -> None:
    """Ray gives the rank the GPU its placement asked for; the worker computes on cuda:0 of it."""
    ray = pytest.importorskip("ray", reason="needs Ray (the device check runs without it)")

    from rlhf_api.loader import parse_spec
    from rlhf_trainer import placement
    from rlhf_trainer.workers.base import Worker
    from rlhf_trainer.workers.group import WorkerGroup

    class Probe(Worker):
        role = "actor"

        def where(self) -> tuple[str, str]:
            return str(self.device), os.environ.get("CUDA_VISIBLE_DEVICES", "")

    spec = parse_spec(
        {
            "model": {"path": str(tiny_model)},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "roles": {"actor": {"resources": {"gpus": 1}}},
        }
    )
    p = placement.role_placement(spec, "actor", cluster=False)
    assert (p.ranks, p.num_gpus, p.device) == (1, 1, "cuda")
    ray.init(num_gpus=_gpus(), include_dashboard=False, ignore_reinit_error=True)
    try:
        group = WorkerGroup(Probe, spec, p.ranks, **p.ray_options(), device=p.device)
        ((device, visible),) = group.call("where")
        assert device == "cuda:0" and visible != ""
        group.shutdown()
    finally:
        ray.shutdown()


def test_bf16_on_gpu_keeps_fp32_master_weights_and_moves_them_at_lr_1e_6(tiny_model: Path) -> None:
    from precision_ranks import batch, full_weights, spec_for, train_once

    from rlhf_trainer.workers import ActorWorker

    worker = ActorWorker(spec_for(tiny_model, "bfloat16", lr=1e-6, micro=4), device="cuda")
    worker.setup()
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    rows = batch(worker.model.config.vocab_size)
    with worker.compute():
        ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], 1).cuda()
        assert worker.model(input_ids=ids).logits.dtype == torch.bfloat16
    before = full_weights(worker)
    after = train_once(worker, rows)
    assert sum(int((before[k] != after[k]).sum()) for k in before) > 0


def _fsdp_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    device = _rank_device(rank)
    sys.path.insert(0, str(ROOT / "tests" / "trainer" / "runtime"))
    import torch.distributed as dist
    from precision_ranks import batch, full_weights, spec_for, train_once

    from rlhf_trainer.workers import ActorWorker

    worker = ActorWorker(
        spec_for(Path(model), "bfloat16", lr=1e-6, micro=2), rank=rank, world_size=world, device=device
    )
    worker.init_group(("127.0.0.1", port))
    assert dist.get_backend() == "nccl"
    worker.setup()
    if world == 1:  # the worker shards only with 2+ ranks: shard by hand over the 1-rank NCCL group
        from rlhf_trainer.workers import modeling
        from rlhf_trainer.workers.distributed import group_device

        worker.model = modeling.shard_model(worker.build_model().cuda(), "bfloat16")
        worker.optimizer = modeling.build_optimizer(worker.model, 1e-6, 0.0)
        worker.scheduler = modeling.build_scheduler(worker.optimizer, "constant", 0, 1)
        one = torch.ones(1, device=group_device())
        dist.all_reduce(one)
        assert one.device.type == "cuda" and float(one) == 1.0
    before = full_weights(worker)
    after = train_once(worker, batch(worker.model.config.vocab_size))  # metrics all-reduce on NCCL
    flag = worker._sync_retry_flag(rank == 0)  # a broadcast on the group's device
    if rank == 0:
        torch.save(
            {
                "changed": sum(int((before[k] != after[k]).sum()) for k in before),
                "dtypes": sorted({str(p.dtype) for p in worker.model.parameters()}),
                "flag": flag,
            },
            out,
        )
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_over_nccl(tiny_model: Path, tmp_path: Path, world: int) -> None:
    """FSDP2 ranks on NCCL: bf16 compute, fp32 shards, metrics and flags on the GPU."""
    _need_gpus(world)
    import torch.multiprocessing as mp

    out = tmp_path / "fsdp.pt"
    mp.spawn(_fsdp_rank, args=(world, _free_port(), str(tiny_model), str(out)), nprocs=world, join=True)
    got = torch.load(out)
    assert got["changed"] > 0 and got["dtypes"] == ["torch.float32"] and got["flag"] is True


def _sync_member(rank: int, port: int, mode: str, out: str) -> None:
    """Rank 0 the source, rank 1 a receiver; `mode` dead: the receiver leaves before the stream."""
    device = _rank_device(rank)
    from rlhf_trainer.sync import SyncGroup, WeightReceiver, connect_store, tensor_digest

    store = connect_store("127.0.0.1", port, is_source=rank == 0, timeout=60)
    me = "actor" if rank == 0 else "r1"
    group = SyncGroup(store, me, timeout=5.0, backend="nccl", device=device)
    group.rebuild(["actor", "r1"], 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = {f"w{i}": torch.randn(1024, 257, generator=gen).to(torch.bfloat16).to(device) for i in range(6)}
    if rank == 0:
        res = group.push(weights.items(), version=3)
        torch.save(
            {"members": res.members, "dropped": res.dropped, "digest": tensor_digest(weights.items())}, out
        )
        return
    if mode == "dead":
        os._exit(0)  # gone without a word: no stream, no ack
    sink = WeightReceiver(device=device)
    group.receive(sink)
    torch.save({"digest": tensor_digest(sink.tensors.items())}, out + ".rx")


@pytest.mark.parametrize("mode", ["alive", "dead"])
def test_nccl_weight_sync(tmp_path: Path, mode: str) -> None:
    """The NCCL backend keeps the gloo path's semantics: bit-exact to a live receiver; a dead one
    is dropped after the timeout and the source (the trainer) lives on."""
    _need_gpus(2)
    import torch.multiprocessing as mp

    out = str(tmp_path / "sync.pt")
    mp.spawn(_sync_member, args=(_free_port(), mode, out), nprocs=2, join=True)
    got: dict[str, Any] = torch.load(out)
    if mode == "alive":
        assert got["members"] == ["r1"] and got["dropped"] == []
        assert torch.load(out + ".rx")["digest"] == got["digest"]
    else:
        assert got["dropped"] == ["r1"] and got["members"] == []


def test_vllm_colocated_sleeps_then_serves_the_updated_weights(tiny_model: Path) -> None:
    """Colocated vLLM on a GPU (sleep mode): generate, sleep while training, wake the weights for
    the update, then greedy output equals transformers' greedy output for the new weights."""
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build (pip install vllm) on the GPU machine")
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine.from_pretrained(
        str(tiny_model),
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.2,
        sleep_mode=True,
        max_new_tokens=8,
        temperature=1.0,
    )
    assert engine.sleep_mode
    prompts = [[5, 6, 7], [8, 9]]
    engine.generate(prompts)
    engine.sleep()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(model.state_dict().items())
    assert engine.asleep == {"kv_cache"}
    got = engine.generate(prompts, greedy=True)
    hf = HFRolloutEngine(model, engine.tokenizer, max_new_tokens=8, temperature=1.0)
    want = hf.generate(prompts, greedy=True)
    assert torch.equal(got.response_ids.cpu(), want.response_ids.cpu())
