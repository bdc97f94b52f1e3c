"""L3.5: pipeline parallelism: the model as DeepSpeed's ``PipelineModule`` (``module``), the schedules' engines
(``dualpipev``, ``zero_bubble``, ``dualpipev_zb``), their async point-to-point sends (``p2p``), the model of how NCCL
matches those messages (``rendezvous``) and the schedules themselves, one record each (``schedules``: stages per
rank, orders, the one timing model, activations in flight, refusals, and which engine runs each).  Every use of
DeepSpeed's private pipeline-engine names is in this folder.  This ``__init__`` imports nothing, so the
standard-library parts load without torch.
"""
