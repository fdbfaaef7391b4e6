"""The NetLoader vLLM loader's choices when a seed fails part way, with real seeds over socketpairs.

The loader (vLLM's DefaultModelLoader with the seed's tensors as its weight
iterator) feeds each verified tensor to the model's `load_weights` while the
rest stream. A seed that fails mid-transfer has by then written some
parameters; the next seed, or the disk, must load every parameter again.
The model here is a small torch module with vLLM's load_weights contract
(copy each named tensor into its parameter, return the names loaded).
"""

from __future__ import annotations

import json
import socket
import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascendserve.netloader import loader as netloader
from ascendserve.netloader.checkpoint import CheckpointIndex, MemorySource
from ascendserve.netloader.client import open_transfer
from ascendserve.netloader.seed import Seed

TOKEN = "unit-loader-token"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Loader"], "model_type": "loader"}))
    gen = torch.Generator().manual_seed(9)
    save_file({"a.weight": torch.randn(256, 64, generator=gen), "b.weight": torch.randn(64, 64, generator=gen),
               "c.bias": torch.randn(64, generator=gen), "d.weight": torch.randn(128, 64, generator=gen)},
              str(tmp_path / "model.safetensors"))
    return tmp_path


class Model(torch.nn.Module):
    """Parameters named as the checkpoint's tensors (a.weight: module a, parameter weight), NaN at first."""

    def __init__(self, want: dict, on_tensor=None):
        super().__init__()
        self.on_tensor = on_tensor or (lambda seen: None)
        for name, t in want.items():
            module, _, leaf = name.partition(".")
            if not hasattr(self, module):
                self.add_module(module, torch.nn.Module())
            getattr(self, module).register_parameter(
                leaf, torch.nn.Parameter(torch.full_like(t, float("nan")), requires_grad=False))
        self.calls: list[list[str]] = []
        self.in_place: list[str] = []  # tensors handed over that already were their parameter's memory

    def load(self, param, tensor) -> None:
        param.data.copy_(tensor)

    def load_weights(self, weights) -> set[str]:
        seen: list[str] = []
        self.calls.append(seen)
        for name, tensor in weights:
            param = self.get_parameter(name)
            if tensor.data_ptr() == param.data_ptr():
                self.in_place.append(name)
            self.load(param, tensor) if name == "b.weight" else param.data.copy_(tensor)
            seen.append(name)
            self.on_tensor(seen)
        return {n for n, _ in self.named_parameters()}


class Transposing(Model):
    """A model whose load_weights stores b.weight transposed (as some loaders reshape what they read):
    torch refuses that copy between aliases of one parameter received in place."""

    def load(self, param, tensor) -> None:
        param.data.copy_(tensor.t())

    @staticmethod
    def expect(tensor):
        return tensor.t()


class Scaling(Model):
    """A model whose load_weights scales b.weight after copying it in: silently wrong in place
    (scaled where it was received), caught by the parameters' checksums after the load."""

    def load(self, param, tensor) -> None:
        param.data.copy_(tensor)
        param.data.mul_(2)

    @staticmethod
    def expect(tensor):
        return tensor * 2


class _CorruptsLast(MemorySource):
    """A seed whose last tensor's bytes differ from its manifest (a flipped bit in transit), sent
    once `go` is set: a test can make the model take the others first."""

    def __init__(self, index):
        super().__init__(index)
        self.last = index.entries[-1]
        self.view(self.last)[5] ^= 0x10
        self.go = threading.Event()

    def send(self, sock, entry, offset=0, count=None):
        if entry is self.last:
            self.go.wait(10)
        super().send(sock, entry, offset, count)


class _DiesInLast(_CorruptsLast):
    """A seed whose process dies part way through its last tensor (a few bytes, then the connection
    drops), once `go` is set."""

    def send(self, sock, entry, offset=0, count=None):
        if entry is not self.last:
            return super().send(sock, entry, offset, count)
        self.go.wait(10)
        sock.sendall(self.view(entry)[offset:offset + 16])
        sock.shutdown(socket.SHUT_RDWR)
        raise ConnectionError("the seed died")


@pytest.fixture
def seeds(model_dir, monkeypatch):
    """Seeds by name ("good"; "bad": corrupts its last tensor; "dead": dies in its last tensor), reached
    over socketpairs (transport 'unit')."""
    index = CheckpointIndex.scan(model_dir)
    made = {"good": Seed(MemorySource(index), TOKEN, "127.0.0.1", 0, handshake_s=5, idle_s=5),
            "bad": Seed(_CorruptsLast(index), TOKEN, "127.0.0.1", 0, handshake_s=5, idle_s=5),
            "dead": Seed(_DiesInLast(index), TOKEN, "127.0.0.1", 0, handshake_s=5, idle_s=5)}

    def transport(address, token, own, rank, timeout_s, max_bytes=None, *, streams=1, targets=None, recycle=False):
        seed = made[address.split(":")[0]]

        def connect():
            ours, theirs = socket.socketpair()
            threading.Thread(target=seed._serve, args=(theirs, ("unit", 0)), daemon=True).start()
            return ours
        transport.recycle.append(recycle)
        return open_transfer(address, token, own, rank, timeout_s, max_bytes, streams=streams, connect=connect,
                             targets=targets, recycle=recycle)

    transport.recycle = []  # what each open was told
    made["bad"].source.go.set()  # a test that wants the last tensor held back clears it
    made["dead"].source.go.set()
    monkeypatch.setitem(netloader.TRANSPORTS, "unit", transport)
    monkeypatch.setenv(netloader.TOKEN_ENV, TOKEN)
    yield made
    for seed in made.values():
        seed.stop()


def _load(model_dir, sources: list[str], fallback: str = "disk", on_tensor=None, kind=Model,
          quantization=None, **more) -> Model:
    from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config

    want = load_file(str(model_dir / "model.safetensors"))
    model = kind(want, on_tensor)
    settings = {"sources": sources, "transport": "unit", "fallback": fallback, "timeout_s": 5.0, **more}
    loader = netloader.NetLoader(LoadConfig(load_format="netloader",
                                            model_loader_extra_config={"netloader": settings}))
    config = SimpleNamespace(model=str(model_dir), revision=None, quantization=quantization, is_moe=False,
                             multimodal_config=None)
    with set_current_vllm_config(VllmConfig(load_config=loader.load_config)):
        loader.load_weights(model, config)
    for name, tensor in want.items():
        expected = kind.expect(tensor) if kind is not Model and name == "b.weight" else tensor
        assert model.get_parameter(name).equal(expected), name
    return model


def test_weights_from_a_seed_stream_into_the_model_received_in_place(model_dir, seeds):
    model = _load(model_dir, ["good:1"])
    assert model.calls == [sorted(model.calls[0])] and len(model.calls[0]) == 4 and seeds["good"].served == 1
    assert sorted(model.in_place) == ["a.weight", "b.weight", "c.bias", "d.weight"]  # no copy, no host buffer
    assert netloader.TRANSPORTS["unit"].recycle == [True]  # parameters in host memory: buffers may be reused


@pytest.mark.parametrize("kind", [Transposing, Scaling])
def test_a_model_that_transforms_a_weight_while_loading_gets_everything_again_not_in_place(model_dir, seeds, kind):
    model = _load(model_dir, ["good:1"], kind=kind)  # b.weight ends up as the model makes it
    assert len(model.calls) == 2 and len(model.calls[1]) == 4 and seeds["good"].served == 2
    first_pass = ["a.weight", "b.weight"] if kind is Transposing else ["a.weight", "b.weight", "c.bias", "d.weight"]
    assert model.in_place == first_pass  # the second pass received into the host buffer


def test_quantized_models_are_not_received_in_place(model_dir, seeds):
    model = _load(model_dir, ["good:1"], quantization="fp8")
    assert model.in_place == [] and len(model.calls) == 1


FAILING = [("bad", "checksum mismatch in d.weight"), ("dead", "closed|reset|Connection")]


@pytest.mark.parametrize("failing, why", FAILING)
def test_a_seed_failing_mid_transfer_means_the_next_seed_loads_every_weight(model_dir, seeds, failing, why):
    go = seeds[failing].source.go
    go.clear()
    model = _load(model_dir, [f"{failing}:1", "good:1"], on_tensor=lambda seen: len(seen) == 3 and go.set())
    first, second = model.calls
    assert len(first) == 3  # the bad seed's first tensors were in the model when its last one failed
    assert sorted(second) == ["a.weight", "b.weight", "c.bias", "d.weight"]  # all again, from the good one


@pytest.mark.parametrize("failing, why", FAILING)
def test_a_seed_failing_mid_transfer_with_no_other_means_the_disk(model_dir, seeds, failing, why):
    model = _load(model_dir, [f"{failing}:1"])
    assert len(model.calls) == 2 and len(model.calls[1]) == 4  # the second: vLLM's disk iterator
    assert seeds["good"].served == 0


@pytest.mark.parametrize("failing, why", FAILING)
def test_a_seed_failing_mid_transfer_with_fallback_fail_stops(model_dir, seeds, failing, why):
    with pytest.raises(RuntimeError, match=f"({why}).*the disk fallback is off"):
        _load(model_dir, [f"{failing}:1"], fallback="fail")


def test_malformed_etcd_settings_are_a_reason_to_load_from_disk(model_dir, seeds):
    model = _load(model_dir, ["auto"], etcd={"endpoints": "http://e:2379"})  # a string, not a list
    assert len(model.calls) == 1 and model.in_place == []  # from disk, with no seed asked
    with pytest.raises(RuntimeError, match="netloader's etcd settings: etcd endpoints must be a list"):
        _load(model_dir, ["auto"], fallback="fail", etcd={"endpoints": "http://e:2379"})
