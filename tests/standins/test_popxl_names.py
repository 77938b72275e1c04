"""The PopXL stand-in exposes only names real PopXL exposes, each where PopXL has it.

The real names are those of graphcore/popart at commit d2f20d78db91: the top level from
``python/popxl/__init__.py.in``, ``popxl.tensor`` from ``python_files/tensor.py``,
``popxl.ops`` from ``python_files/ops/__init__.py`` and ``popxl.transforms`` from
``python_files/transforms/__init__.py``.
"""
from __future__ import annotations

import pytest

import ipu_standins.popxl as popxl_standin

POPXL_TOP = {
    "get_current_graph", "get_main_graph", "get_ir", "gcg", "gmg", "gir", "in_sequence",
    "name_scope", "ipu", "io_tiles", "dtype", "bool", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "half", "float8_143", "float8_152", "float16",
    "float", "float32", "double", "float64", "complex64", "complex128", "Graph", "Ir", "Module",
    "create_seeds", "RemoteBuffer", "remote_buffer", "ReplicaGrouping", "HostToDeviceStream",
    "DeviceToHostStream", "h2d_stream", "d2h_stream", "Tensor", "variable", "remote_variable",
    "remote_replica_sharded_variable", "replica_sharded_variable", "replica_sharded_buffer",
    "constant", "graph_input", "graph_output", "TensorByRef", "TensorSpec", "TensorStorage",
    "TensorLocation", "ReplicatedTensorSharding", "TileSet", "ExecutionContext", "Session",
    # submodules, reached as attributes of the package
    "ops", "transforms", "tensor", "dtypes", "context", "graph", "ir", "session", "streams",
}
POPXL_TENSOR = {
    "TensorSpec", "Tensor", "Variable", "Constant", "TensorLike", "variable", "constant",
    "remote_variable", "remote_replica_sharded_variable", "replica_sharded_buffer",
    "replica_sharded_variable", "graph_input", "graph_output", "TensorByRef",
}
POPXL_OPS = set("""
    abs add add_ argmax argmin average_pool max_pool batch_norm_inference call call_with_info
    CallSiteInfo cast pow2scale_cast_to_fp8 pow2scale_cast_from_fp8 concat concat_ swish swish_
    greater conv conv_pow2scaled conv_transpose conv_transpose_pow2scaled PadType cos cumsum
    roi_align interpolate conditional conditional_with_info detach detach_ div dropout
    dynamic_slice dynamic_update dynamic_update_ equal exp exp_ log log2 onehot topk fmod gather
    groupedgather tied_gather gelu gelu_ geluerf geluerf_ group_norm layer_norm host_load
    host_store increment_mod increment_mod_ init io_tile_copy ipu_copy l1 l2 lamb_square
    logical_and logical_not logical_or logsum logsumexp matmul matmul_pow2scaled max maximum
    mean median min mul nll_loss nll_loss_with_softmax_grad negate pow print_tensor prod
    split_random_seed random_uniform random_normal relu relu_ reshape reshape_ flatten flatten_
    remote_load remote_load_ remote_store repeat repeat_with_info scaled_add scaled_add_ scatter
    scatter_reduce shaped_dropout sin slice slice_ softmax split sqrt squeeze sub subsample sum
    sumsquare tanh transpose transpose_ where histogram collectives var_updates identity rename
    isnan isinf isfinite ceil clip clamp sign utils
""".split())
POPXL_TRANSFORMS = {
    "ExpectedConnectionType", "ExpectedConnection", "GradGraphInfo", "autodiff",
    "merge_exchange", "io_tile_exchange", "decompose_sum",
}


def public(names) -> set:
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("module, real", [
    (popxl_standin, POPXL_TOP),
    (popxl_standin.tensor, POPXL_TENSOR),
    (popxl_standin.ops, POPXL_OPS),
    (popxl_standin.transforms, POPXL_TRANSFORMS),
], ids=["popxl", "popxl.tensor", "popxl.ops", "popxl.transforms"])
def test_every_name_the_stand_in_exposes_is_popxl_s_in_the_same_place(module, real):
    exposed = public(dir(module)) | set(module.__all__)
    assert exposed <= real, sorted(exposed - real)
    assert all(hasattr(module, name) for name in module.__all__)

