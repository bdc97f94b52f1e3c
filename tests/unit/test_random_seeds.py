"""Every RNG stream of a run has its own seed: no (kind, tp, pp, dp) pair of streams coincides, even at 1,024 ranks."""

from __future__ import annotations

from ds_megatron.random import TENSOR_PARALLEL, stream_seed


def test_no_two_streams_of_a_large_run_share_a_seed():
    tp, pp, dp = 8, 8, 16
    seeds = [stream_seed(1234, "default", pp=p, dp=d) for p in range(pp) for d in range(dp)]
    seeds += [
        stream_seed(1234, TENSOR_PARALLEL, pp=p, dp=d, tp=t) for p in range(pp) for d in range(dp) for t in range(tp)
    ]
    assert len(set(seeds)) == len(seeds) == pp * dp * (1 + tp)
    assert all(0 <= s < 2**63 for s in seeds)
    # the collision the additive offsets had: tensor-parallel (tp 0, pp 0, dp 0) vs default (pp 7, dp 2)
    assert stream_seed(1234, TENSOR_PARALLEL, pp=0, dp=0, tp=0) != stream_seed(1234, "default", pp=7, dp=2)


def test_seeds_depend_on_the_base_seed_and_are_stable():
    assert stream_seed(1, "default", pp=0, dp=0) != stream_seed(2, "default", pp=0, dp=0)
    assert stream_seed(1, "default", pp=0, dp=0) == stream_seed(1, "default", dp=0, pp=0)


class FakeCudaRNG:
    """CUDA's default generator as the tracker sees it, on a CPU-only build: philox's raw state is 16 bytes (the
    seed and the offset), and ``set_rng_state`` refuses any other size ("RNG state is wrong size"), as CUDA's does;
    ``manual_seed`` sets the seed and a zero offset."""

    def __init__(self, monkeypatch):
        import torch

        self.state = torch.zeros(16, dtype=torch.uint8)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "manual_seed", self.manual_seed)

    def set_rng_state(self, state, device="cuda"):
        if state.numel() != 16:
            raise RuntimeError("RNG state is wrong size")
        self.state = state.clone()

    def manual_seed(self, seed):
        import torch

        raw = (seed % 2**64).to_bytes(8, "little") + bytes(8)
        self.state = torch.tensor(list(raw), dtype=torch.uint8)

    def seeded(self, seed):
        self.manual_seed(seed)
        return self.state.clone()


def _saved(tracker, tmp_path):
    """The tracker's states as ``save_run`` writes them and ``load_run`` reads them back (weights only)."""
    import torch

    from ds_megatron.checkpoint import safe_load

    torch.save(tracker.state_dict(), tmp_path / "rng_rank00000.pt")
    return safe_load.load(tmp_path / "rng_rank00000.pt")


def test_rng_states_saved_on_cpu_resume_on_cuda_reseeded_by_step(monkeypatch, tmp_path):
    import torch

    from ds_megatron.random import build_rng

    saved = _saved(build_rng(7, 1, 0, 2, "cpu"), tmp_path)
    assert saved["device_type"] == "cpu" and saved["default"].numel() == 5056
    cuda = FakeCudaRNG(monkeypatch)
    resumed = []
    for _ in range(2):  # two resumes of one checkpoint draw the same
        tracker = build_rng(7, 1, 0, 2, "cuda")
        warning = tracker.load_state_dict(saved, step=40)
        assert "saved on cpu and this run is on cuda" in warning and "step 40" in warning
        resumed.append((tracker.get_states(), torch.get_rng_state()))
    assert all(torch.equal(resumed[0][0][k], resumed[1][0][k]) for k in resumed[0][0])
    assert torch.equal(resumed[0][1], resumed[1][1])
    tp_state = resumed[0][0][TENSOR_PARALLEL]
    assert torch.equal(tp_state, cuda.seeded(stream_seed(7, TENSOR_PARALLEL, pp=0, dp=2, tp=1, step=40)))
    assert torch.equal(resumed[0][0]["default"], cuda.seeded(stream_seed(7, "default", pp=0, dp=2, step=40)))
    # a fresh start at step 0 keeps the seeds a run has always had
    assert not torch.equal(tp_state, cuda.seeded(stream_seed(7, TENSOR_PARALLEL, pp=0, dp=2, tp=1)))


def test_rng_states_saved_on_cuda_resume_on_cpu_reseeded_by_step(monkeypatch, tmp_path):
    import torch

    from ds_megatron.random import build_rng

    FakeCudaRNG(monkeypatch)
    saved = _saved(build_rng(7, 0, 1, 0, "cuda"), tmp_path)
    assert saved["device_type"] == "cuda" and saved["default"].numel() == 16
    draws = []
    for _ in range(2):
        tracker = build_rng(7, 0, 1, 0, "cpu")
        assert "saved on cuda and this run is on cpu" in tracker.load_state_dict(saved, step=3)
        with tracker.fork(TENSOR_PARALLEL):
            tp_draw = torch.rand(4)
        draws.append((tp_draw, torch.rand(4)))  # the tensor-parallel stream, then the default one
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    torch.manual_seed(stream_seed(7, "default", pp=1, dp=0, step=3))
    assert torch.equal(draws[0][1], torch.rand(4))


def test_rng_states_on_the_same_device_type_resume_exactly(tmp_path):
    """A file of either format (with the device type, or without it: read off the state's size) on the CPU."""
    import torch

    from ds_megatron.random import build_rng

    tracker = build_rng(7, 0, 0, 0, "cpu")
    torch.rand(3)
    saved = _saved(tracker, tmp_path)
    expected = torch.rand(5)
    old_format = {k: v for k, v in saved.items() if k != "device_type"}
    for states in (saved, old_format):
        other = build_rng(8, 0, 0, 0, "cpu")
        assert other.load_state_dict(states, step=9) is None
        assert torch.equal(torch.rand(5), expected)
