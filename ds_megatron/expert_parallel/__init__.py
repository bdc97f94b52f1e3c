"""L2.1: expert parallelism: the group layout and its refusals (``layout``, standard library only), token dispatch and
combine over the EP group with variable-split all-to-alls (``dispatch``), the same exchange in chunks of local
experts overlapped with their compute (``overlap``) and the expert-parallel MoE layer with the gradient rule of its
parameters (``layer``).

Process groups are always passed in; nothing here keeps global state.
"""
