"""L3.5: DualPipeV's pipeline module (what the rest must know of each schedule is its record,
``pipeline_parallel.schedules``, which names the module and engine classes that run it).

- DeepSpeed's ``DualPipeVModule`` / ``DualPipeVEngine`` (``DualPipeVSchedule``; with deferred weight gradients: the
  same module, the engine and schedule of :mod:`ds_megatron.pipeline_parallel.dualpipev_zb`).  The layers are cut
  into 2p stages; rank r builds stage r (phase 0, activations flow towards rank p-1) and stage 2p-1-r (phase 1, back
  towards rank 0), so rank 0 holds the embedding, the output layer and the loss, and a tied embedding is one module
  there (no tied-gradient exchange).  ``deepspeed.initialize`` picks ``DualPipeVEngine`` for such a module.

What DeepSpeed's DualPipeV needs from ds_megatron (subclassed or configured, nothing forked; gloo and the CPU
accelerator run it as is, its p2p going through ``batch_isend_irecv``, whose commit ds_megatron makes wait for its
receives only, :mod:`ds_megatron.pipeline_parallel.p2p`):
- ``PipelineModel``'s forward runs its recompute segments over ``forward_funcs``, and DualPipeV swaps
  ``forward_funcs`` per phase (``activate_phase``), so the segments are computed per phase and swapped with them;
- the once-per-step SP gradient sum replaces ``ReduceTiedGrads`` in the engine's own class's instruction table
  (``engine.install_step_sp_grad_sync``), which holds DualPipeV's phase-aware instructions;
- TP partitioning of boundary tensors off at tp > 1 (the engine asserts it), fp16 refused (another gradient norm than
  1F1B's, measured), at least 2p micro-batches per forward (sampling feeds one window 2p times, ``generate.py``),
  logits on rank 0.
What upstream would need for less of that: an inference forward of fewer than 2p micro-batches, fp16 loss scaling
checked with two stages per rank, a hook after ``ReduceTiedGrads`` instead of a replaced instruction table, and the
weight-gradient split of zero-bubble schedules (DeepSpeed's DualPipeV keeps each weight gradient in its backward;
``dualpipev-zb``, :mod:`ds_megatron.pipeline_parallel.dualpipev_zb`, splits it on DualPipeV's module).
"""

from __future__ import annotations

from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from ds_megatron.pipeline_parallel.module import PipelineModel


class DualPipeVModel(PipelineModel, DualPipeVModule):
    """:class:`PipelineModel` cut into 2p stages, two per rank (DeepSpeed's ``DualPipeVModule``).  Recompute segments
    (full recompute's chunks of blocks) are per phase: each phase's stage is recomputed as 1F1B would recompute a
    stage of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        segments = []
        for phase in (0, 1):
            DualPipeVModule.activate_phase(self, phase)
            segments.append(self._segments())
        self.phase_segments = segments
        self.activate_phase(0)

    def _partition_layers(self, method="uniform"):
        """DeepSpeed's ``DualPipeVModule._partition_layers`` (2p stages; phase 0 the stage ``stage_id``, phase 1 its
        mirror 2p-1-r), with the boundaries from ``PipelineModel``'s table (``module.stage_parts``): DeepSpeed's
        version would call the next class after ``DualPipeVModule`` in this class's order, DeepSpeed's partitioner."""
        self.num_stages *= 2
        PipelineModel._partition_layers(self, method)
        mirror = self.num_stages - 1 - self.stage_id
        self.phase_bounds = [(self._local_start, self._local_stop), (self.parts[mirror], self.parts[mirror + 1])]

    def activate_phase(self, phase: int) -> None:
        super().activate_phase(phase)
        if getattr(self, "phase_segments", None) is not None:  # None while DeepSpeed builds the two stages
            self.segments = self.phase_segments[phase]
