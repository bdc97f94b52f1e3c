"""L1: named RNG states for dropout under tensor/sequence parallelism.

Two states per process:
- ``default`` (the global torch RNG): seeded from (seed, pp_rank, dp_rank): identical across the ranks of a TP
  group, so dropout in replicated regions draws the same mask on every TP rank; different across DP ranks.
- ``tensor-parallel``: seeded from (seed, pp_rank, dp_rank, tp_rank): different on each TP rank, for dropout on
  TP-split tensors (attention probabilities of the local heads) and, under SP, on sequence shards.

Seeds are 63-bit hashes of the stream's name and coordinates (``stream_seed``), so no two streams of a run
coincide: additive offsets (seed + 100 pp + 1009 dp, + 2718 + tp) made the tensor-parallel stream of (tp 0, pp 0,
dp 0) equal the default stream of (pp 7, dp 2) at tp 8 pp 8 dp 16.

``fork(name)`` swaps a state in for a ``with`` block and saves its advance on exit.  Recompute replays a region by
restoring the states captured before it (``get_states`` / ``set_states``; without a tracker, the global generators
of ``global_rng_states``: the CPU's and the current CUDA device's).

A state is one device type's raw generator state (the CPU's mt19937: 5,056 bytes; CUDA's philox: 16), which the
other device type refuses.  ``state_dict`` therefore records the device type, and ``load_state_dict`` of states
saved on the other one (a CPU run resumed on GPUs, or back) reseeds every stream from the run's seed, its
coordinates and the step it resumes at, so that two resumes of one checkpoint draw the same masks; the caller
warns once.  A file without the device type (written before it was recorded) has it read off its state's size.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

DEFAULT = "default"
TENSOR_PARALLEL = "tensor-parallel"


def _get_global(device_type: str) -> torch.Tensor:
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_global(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


# The size in bytes of one generator's raw state per device type (torch's CPU mt19937 and CUDA philox).
STATE_BYTES = {"cpu": 5056, "cuda": 16}
DEVICE_TYPE_KEY = "device_type"  # the entry of a state dict naming its device type


class RNGTracker:
    """Named RNG states on one device type ("cpu" or "cuda").  The default state is the global RNG itself.
    ``streams``: (seed, pp, dp, tp) the streams were seeded from (``build_rng``), which lets states saved on
    another device type be replaced by a deterministic reseed; None for a tracker built by hand."""

    def __init__(self, device_type: str = "cpu", streams: tuple[int, int, int, int] | None = None):
        self.device_type = device_type
        self.streams = streams
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states or name == DEFAULT:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_global(self.device_type)
        _seed_device(self.device_type, seed)
        self._states[name] = _get_global(self.device_type)
        _set_global(self.device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        if name == DEFAULT:
            yield
            return
        saved = _get_global(self.device_type)
        _set_global(self.device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_global(self.device_type)
            _set_global(self.device_type, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """All states including the default (global) one, as copies."""
        states = {name: s.clone() for name, s in self._states.items()}
        states[DEFAULT] = _get_global(self.device_type)
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        for name, s in states.items():
            if name == DEFAULT:
                _set_global(self.device_type, s)
            else:
                self._states[name] = s.clone()

    def state_dict(self) -> dict[str, torch.Tensor | str]:
        """Every state (on the CPU, for the file) and the device type they belong to."""
        return {**{name: s.cpu() for name, s in self.get_states().items()}, DEVICE_TYPE_KEY: self.device_type}

    def load_state_dict(self, states: dict[str, torch.Tensor | str], step: int = 0) -> str | None:
        """Restore saved states; states of the other device type reseed every stream instead (from the seed, the
        coordinates and ``step``, the step the run resumes at).  Returns the line to warn with then, else None."""
        states = dict(states)
        saved = states.pop(DEVICE_TYPE_KEY, None) or device_type_of_state(states[DEFAULT])
        if saved == self.device_type:
            self.set_states(states)
            return None
        if self.streams is None:
            raise ValueError(f"RNG states saved on {saved} cannot be loaded on {self.device_type}")
        seed_streams(self, *self.streams, step=step)
        return (
            f"RNG states were saved on {saved} and this run is on {self.device_type}: every dropout stream is "
            f"reseeded from the seed and step {step} (masks do not continue those of the saved run)"
        )


def global_rng_states() -> dict[str, torch.Tensor]:
    """The global generators a region run without a tracker may draw from: the CPU's and, once CUDA is in use
    (initialised), the current device's, which every dropout on a CUDA tensor draws from (the CPU's alone would
    leave a recompute's CUDA masks unreplayed)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        states["cuda"] = _get_global("cuda")
    return states


def set_global_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Restore what ``global_rng_states`` captured."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        _set_global("cuda", states["cuda"])


def _seed_device(device_type: str, seed: int) -> None:
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def stream_seed(seed: int, name: str, **coords: int) -> int:
    """A 63-bit seed for the RNG stream ``name`` at ``coords``: distinct streams get unrelated seeds."""
    key = f"{seed}/{name}/" + "/".join(f"{k}={v}" for k, v in sorted(coords.items()))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def device_type_of_state(state: torch.Tensor) -> str:
    """The device type a raw generator state belongs to, from its size (files that did not record it)."""
    found = next((kind for kind, size in STATE_BYTES.items() if state.numel() == size), None)
    if found is None:
        raise ValueError(f"an RNG state of {state.numel()} bytes is neither a CPU nor a CUDA generator's")
    return found


def seed_streams(tracker: RNGTracker, seed: int, pp_rank: int, dp_rank: int, tp_rank: int, step: int = 0) -> None:
    """Seed the default state and the tensor-parallel one (see the module docstring); ``step`` > 0 keys both by the
    step as well (the reseed of a resume on another device type)."""
    at = {"step": step} if step else {}
    default_seed = stream_seed(seed, "default", pp=pp_rank, dp=dp_rank, **at)
    torch.manual_seed(default_seed)
    if tracker.device_type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker._states.pop(TENSOR_PARALLEL, None)
    tracker.add(TENSOR_PARALLEL, stream_seed(seed, TENSOR_PARALLEL, pp=pp_rank, dp=dp_rank, tp=tp_rank, **at))


def build_rng(seed: int, tp_rank: int, pp_rank: int, dp_rank: int, device_type: str = "cpu") -> RNGTracker:
    """Seed the default state and create the tensor-parallel one (see the module docstring)."""
    tracker = RNGTracker(device_type, streams=(seed, pp_rank, dp_rank, tp_rank))
    seed_streams(tracker, seed, pp_rank, dp_rank, tp_rank)
    return tracker
