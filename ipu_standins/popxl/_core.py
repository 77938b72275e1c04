"""The core of the PopXL stand-in: dtypes, tensors, graphs, the IR and the session.

Its namespace, with ``ops``, ``transforms`` and ``tensor``, is :mod:`ipu_standins.popxl`; the op
modules build on this one, which imports none of them. The ops that ``Tensor``'s operators add
(``+``, ``@``, ``.T``, ...) are written here, and ``ops`` serves them under PopXL's names (real
PopXL's ``Tensor`` imports ``popxl.ops`` when an operator runs; here no module imports one that
imports it back).
"""
from __future__ import annotations

import contextlib
import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ._float8 import F143, F152, Float8Format

# The top-level names of the stand-in (:mod:`ipu_standins.popxl` adds ops, transforms, tensor).
__all__ = [
    "dtype", "float16", "float32", "int32", "float8_143", "float8_152",
    "Tensor", "TensorSpec", "Graph", "Ir", "Session",
    "HostToDeviceStream", "DeviceToHostStream", "h2d_stream", "d2h_stream",
    "variable", "constant", "in_sequence",
]


# ----------------------------------------------------------------------------------- dtypes


class dtype:
    """A PopXL dtype (popart: python/popxl/python_files/dtypes.py, docs/popxl/datatype.rst).

    FP8 tensors hold their codes in uint8, as PopART does on the device ("we reinterpret here
    as unsigned char", willow/src/popx/op/pow2scalethencastx.cpp)."""

    def __init__(self, name: str, torch_dtype: torch.dtype, fp8: Optional[Float8Format] = None):
        self.name = name
        self.torch_dtype = torch_dtype
        self.fp8 = fp8

    def __repr__(self) -> str:  # dtypes.py: the module's path and the name
        return f"popxl.dtypes.{self.name}"


float16 = dtype("float16", torch.float16)
float32 = dtype("float32", torch.float32)
int32 = dtype("int32", torch.int32)
_bool = dtype("bool", torch.bool)
float8_143 = dtype("float8_143", torch.uint8, F143)  # 1 sign, 4 exponent, 3 mantissa bits, bias 8
float8_152 = dtype("float8_152", torch.uint8, F152)  # 1 sign, 5 exponent, 2 mantissa bits, bias 16
_DTYPES = (float16, float32, int32, _bool)


def _from_torch(value: torch.Tensor) -> dtype:
    for candidate in _DTYPES:
        if candidate.torch_dtype == value.dtype:
            return candidate
    raise TypeError(f"no PopXL stand-in dtype for torch {value.dtype}")


# ----------------------------------------------------------------------------------- tensors

TensorLike = Union["Tensor", float, int, np.ndarray]


class Tensor:
    """A graph tensor (popart: python/popxl/python_files/tensor.py): shape and dtype are known
    when it is created; arithmetic operators add ops to the current graph, turning Python
    numbers into constants of the tensor's own dtype (``Tensor._ensure_tensor``)."""

    def __init__(self, graph: Graph, shape: Tuple[int, ...], dtype_: dtype, name: str):
        self.graph = graph
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype_
        self.name = name

    def __repr__(self) -> str:
        kind = type(self).__name__.lstrip("_")  # Variable and Constant are private here
        return f"{kind}[{self.name} {self.dtype} {self.shape}]"

    # Identity, not elementwise comparison: tensors are dict keys (tensor.py __eq__/__hash__).
    __hash__ = object.__hash__

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def nelms(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def T(self) -> Tensor:
        return transpose(self)

    def transpose(self, permutation: Optional[Sequence[int]] = None) -> Tensor:
        return transpose(self, permutation)

    def reshape(self, shape: Sequence[int]) -> Tensor:
        return reshape(self, shape)

    def detach(self) -> Tensor:
        return detach(self)

    def __len__(self) -> int:
        if not self.shape:
            raise ValueError("Tensor is a scalar and doesn't have a length.")
        return self.shape[0]

    def _ensure_tensor(self, value: TensorLike) -> Tensor:
        if isinstance(value, Tensor):
            return value
        made = constant(value, self.dtype)
        if made.nelms == 0:  # tensor.py: most likely a mistake
            raise ValueError(f"The value has 0 elements: {value!r} ({type(value).__name__})")
        return made

    def __add__(self, other: TensorLike) -> Tensor:
        return add(self, self._ensure_tensor(other))

    def __radd__(self, other: TensorLike) -> Tensor:
        return add(self._ensure_tensor(other), self)

    def __sub__(self, other: TensorLike) -> Tensor:
        return sub(self, self._ensure_tensor(other))

    def __rsub__(self, other: TensorLike) -> Tensor:
        return sub(self._ensure_tensor(other), self)

    def __mul__(self, other: TensorLike) -> Tensor:
        return mul(self, self._ensure_tensor(other))

    def __rmul__(self, other: TensorLike) -> Tensor:
        return mul(self._ensure_tensor(other), self)

    def __truediv__(self, other: TensorLike) -> Tensor:
        return div(self, self._ensure_tensor(other))

    def __rtruediv__(self, other: TensorLike) -> Tensor:
        return div(self._ensure_tensor(other), self)

    def __neg__(self) -> Tensor:
        return negate(self)

    def __matmul__(self, other: TensorLike) -> Tensor:
        return matmul(self, self._ensure_tensor(other))


class Variable(Tensor):
    """``popxl.tensor.Variable``: main-graph state a session holds and ops may update in place."""

    def __init__(self, graph: Graph, data: torch.Tensor, dtype_: dtype, name: str):
        super().__init__(graph, tuple(data.shape), dtype_, name)
        self.data = data


class Constant(Tensor):
    """``popxl.tensor.Constant``: a value fixed when the graph is built."""

    def __init__(self, graph: Graph, data: torch.Tensor, dtype_: dtype, name: str):
        super().__init__(graph, tuple(data.shape), dtype_, name)
        self.data = data


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype only, for ``Ir.create_graph`` (tensor.py ``TensorSpec``)."""

    shape: Tuple[int, ...]
    dtype: dtype


def _as_torch(data: Any, dtype_: Optional[dtype]) -> Tuple[torch.Tensor, dtype]:
    """Host data to a tensor; without a dtype, NumPy's inference downcast to 32 bits, as
    ``popxl.constant`` / ``popxl.variable`` do (tensor.py, ``downcast=True``)."""
    array = np.asarray(data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else data)
    if dtype_ is None:
        if array.dtype == np.bool_:
            dtype_ = _bool
        elif np.issubdtype(array.dtype, np.integer):
            dtype_ = int32
        elif array.dtype == np.float16:
            dtype_ = float16
        else:
            dtype_ = float32
    if dtype_.fp8 is not None:
        raise TypeError("FP8 host data must be cast with host_pow2scale_cast_to_fp8 first")
    return torch.from_numpy(np.array(array)).to(dtype_.torch_dtype), dtype_


def constant(data: Any, dtype: Optional[dtype] = None, name: Optional[str] = None) -> Constant:
    """``popxl.constant`` (tensor.py): a tensor fixed at graph construction, in the current
    graph."""
    graph = _current_graph()
    value, dtype_ = _as_torch(data, dtype)
    return Constant(graph, value, dtype_, graph._name(name or "constant"))


def variable(data: Any, dtype: Optional[dtype] = None, name: Optional[str] = None) -> Variable:
    """``popxl.variable`` (tensor.py): "Must be created in the main graph scope"."""
    graph = _current_graph()
    if graph is not graph.ir.main_graph:
        raise ValueError("variables must be created in the main graph")
    value, dtype_ = _as_torch(data, dtype)
    new = Variable(graph, value, dtype_, graph._name(name or "variable"))
    graph.ir._variables.append(new)
    return new


# ------------------------------------------------------------------------------------ graphs


class Run:
    """Everything one ``Session.run`` reads and writes: variables, streams, kept values."""

    def __init__(self, variables: Dict[Variable, torch.Tensor],
                 inputs: Dict[HostToDeviceStream, List[torch.Tensor]],
                 keep: Optional[Dict[Tensor, torch.Tensor]]):
        self.variables = variables
        self.inputs = inputs
        self.loaded: Dict[HostToDeviceStream, int] = {}
        self.stored: Dict[DeviceToHostStream, List[torch.Tensor]] = {}
        self.keep = keep


_OpFn = Callable[..., Tuple[torch.Tensor, ...]]


@dataclass
class _Op:
    name: str
    fn: _OpFn  # fn(run, *input_values) -> output values
    inputs: Tuple[Tensor, ...]
    outputs: Tuple[Tensor, ...]
    stream: Optional[HostToDeviceStream] = None  # what a host_load reads


_graph_stack: List[Graph] = []


def _current_graph() -> Graph:
    if not _graph_stack:
        raise RuntimeError("no current graph: build inside `with ir.main_graph:`")
    return _graph_stack[-1]


class Graph:
    """A PopXL graph (popart: python/popxl/python_files/graph.py): ops in creation order,
    with inputs and outputs; ``with graph:`` makes it the current graph."""

    def __init__(self, ir: Ir, name: str):
        self.ir = ir
        self.name = name
        self._ops: List[_Op] = []
        self._inputs: List[Tensor] = []
        self._outputs: List[Tensor] = []
        self._count = 0

    def __repr__(self) -> str:
        return f"Graph[{self.name}]"

    __hash__ = object.__hash__

    @property
    def inputs(self) -> Tuple[Tensor, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> Tuple[Tensor, ...]:
        return tuple(self._outputs)

    def __enter__(self) -> Graph:
        _graph_stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _graph_stack.pop()

    def _name(self, base: str) -> str:
        self._count += 1
        return f"{self.name}/{base}.{self._count}"

    def _run(self, run: Run, values: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        env: Dict[Tensor, torch.Tensor] = dict(zip(self._inputs, values))

        def value(t: Tensor) -> torch.Tensor:
            if isinstance(t, Variable):
                return run.variables[t]  # read when the op runs: in-place updates are seen
            if isinstance(t, Constant):
                return t.data
            return env[t]

        for op in self._ops:
            results = op.fn(run, *[value(t) for t in op.inputs])
            for output, result in zip(op.outputs, results):
                env[output] = result
                if run.keep is not None:
                    run.keep[output] = result
        return [value(t) for t in self._outputs]


def _check_in_graph(graph: Graph, tensors: Sequence[Tensor]) -> None:
    """PopXL refuses inputs from another graph (ops/utils.py ``check_in_graph``)."""
    for t in tensors:
        if t.graph is not graph:
            raise ValueError(f"{t} is not in the current graph {graph}; pass it as an input")


def _zeros(t: Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype.torch_dtype)


def add_op(name: str, fn: Callable[..., Any], inputs: Sequence[Tensor],
            out_dtypes: Optional[Sequence[dtype]] = None) -> List[Tensor]:
    """Add a pure op ``fn(*input_values) -> value(s)`` to the current graph. Output shapes come
    from running ``fn`` once on zeros; ``out_dtypes`` names dtypes torch cannot tell apart
    (FP8 codes are uint8)."""

    def run_fn(run: Run, *values: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        result = fn(*values)
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    example = run_fn(None, *[_zeros(t) for t in inputs])  # type: ignore[arg-type]
    dtypes = list(out_dtypes) if out_dtypes is not None else [_from_torch(e) for e in example]
    return add_stateful_op(name, run_fn, inputs, [(tuple(e.shape), d)
                                                   for e, d in zip(example, dtypes)])


def add_stateful_op(name: str, fn: _OpFn, inputs: Sequence[Tensor],
                     outputs: Sequence[Tuple[Tuple[int, ...], dtype]],
                     stream: Optional[HostToDeviceStream] = None) -> List[Tensor]:
    """Add an op ``fn(run, *input_values) -> values`` that may read or write the run's state."""
    graph = _current_graph()
    _check_in_graph(graph, inputs)
    tensors = tuple(Tensor(graph, shape, d, graph._name(name)) for shape, d in outputs)
    graph._ops.append(_Op(name, fn, tuple(inputs), tensors, stream))
    return list(tensors)


def same_dtype(name: str, *tensors: Tensor) -> None:
    if len({t.dtype.name for t in tensors}) > 1:
        raise TypeError(f"{name}: operands must have the same dtype, got "
                        f"{[t.dtype for t in tensors]}")


# ------------------------------------------ the ops of Tensor's operators (popxl.ops has them)


def add(lhs: Tensor, rhs: Tensor) -> Tensor:
    """add.py: elementwise, NumPy broadcasting, operands of one dtype."""
    same_dtype("add", lhs, rhs)
    return add_op("add", torch.add, [lhs, rhs])[0]

def sub(lhs: Tensor, rhs: Tensor) -> Tensor:
    """sub.py: elementwise, NumPy broadcasting, operands of one dtype."""
    same_dtype("sub", lhs, rhs)
    return add_op("sub", torch.sub, [lhs, rhs])[0]

def mul(lhs: Tensor, rhs: Tensor) -> Tensor:
    """mul.py: elementwise, NumPy broadcasting, operands of one dtype."""
    same_dtype("mul", lhs, rhs)
    return add_op("mul", torch.mul, [lhs, rhs])[0]

def div(lhs: Tensor, rhs: Tensor) -> Tensor:
    """div.py: elementwise, NumPy broadcasting, operands of one dtype."""
    same_dtype("div", lhs, rhs)
    return add_op("div", torch.div, [lhs, rhs])[0]

def negate(t: Tensor) -> Tensor:
    """negate.py."""
    return add_op("negate", torch.neg, [t])[0]

def detach(t: Tensor) -> Tensor:
    """detach.py: "numerically equivalent to the identity op"; no gradient flows through it."""
    return add_op("detach", torch.Tensor.detach, [t])[0]

def reshape(t: Tensor, shape: Sequence[int]) -> Tensor:
    """reshape.py: at most one -1."""
    shape = tuple(shape)
    if any(s < -1 or s == 0 for s in shape) or shape.count(-1) > 1:
        raise ValueError(f"invalid shape {shape} for reshape")
    return add_op("reshape", lambda x: x.reshape(shape), [t])[0]

def transpose(t: Tensor, permutation: Optional[Sequence[int]] = None) -> Tensor:
    """transpose.py: permute the axes; reverse them by default."""
    perm = tuple(permutation) if permutation is not None else tuple(reversed(range(t.rank)))
    dtypes = [t.dtype]  # FP8 codes stay FP8 (popxl-addons transposes FP8 weights with .T)
    return add_op("transpose", lambda x: x.permute(perm), [t], dtypes)[0]

def matmul(lhs: Tensor, rhs: Tensor) -> Tensor:
    """matmul.py: NumPy matmul rules, operands of one dtype, output in that dtype."""
    same_dtype("matmul", lhs, rhs)
    return add_op("matmul", torch.matmul, [lhs, rhs])[0]


# ------------------------------------------------------------------------------- ir, graphs


class Ir:
    """``popxl.Ir`` (popart: python/popxl/python_files/ir.py)."""

    def __init__(self) -> None:
        self._variables: List[Variable] = []
        self._graphs = 0
        self.main_graph = Graph(self, "main")
        # ir.py: "the number of iterations required for each session.run call": each
        # host_load of a stream takes the next of this many batches (docs/popxl/session.rst).
        self.num_host_transfers = 1
        self.replication_factor = 1

    def create_graph(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        """``Ir.create_graph`` (ir.py): tensors among the arguments (alone, or all the
        elements of a list or of ``*args``) become graph inputs of the same shape and dtype,
        in signature order; the function's returned tensors become the graph outputs."""
        signature = inspect.signature(fn)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self._graphs += 1
        graph = Graph(self, f"{getattr(fn, '__qualname__', 'graph')}.{self._graphs}")
        arguments = dict(bound.arguments)
        with graph:
            for name, arg in bound.arguments.items():
                if isinstance(arg, (Tensor, TensorSpec)):
                    arguments[name] = graph_input(graph, arg, name)
                elif isinstance(arg, (list, tuple)) and arg and all(
                        isinstance(a, (Tensor, TensorSpec)) for a in arg):
                    arguments[name] = [graph_input(graph, a, f"{name}_{i}")
                                       for i, a in enumerate(arg)]
            new = inspect.BoundArguments(signature, arguments)  # type: ignore[arg-type]
            outputs = fn(*new.args, **new.kwargs)
            if outputs is None:
                outputs = []
            if isinstance(outputs, Tensor):
                outputs = [outputs]
            for out in outputs:
                if not isinstance(out, Tensor) or out.graph is not graph:
                    raise ValueError(f"graph output {out!r} is not a tensor of {graph}")
                graph._outputs.append(out)
        return graph


def graph_input(graph: Graph, spec: Union[Tensor, TensorSpec], name: str) -> Tensor:
    new = Tensor(graph, spec.shape, spec.dtype, graph._name(name))
    graph._inputs.append(new)
    return new


@contextlib.contextmanager
def in_sequence(mode: bool = True) -> Iterator[None]:
    """``popxl.in_sequence`` (context.py): ops run in creation order. Here every graph always
    runs in creation order, so this only marks where the model asks for it."""
    yield


# ------------------------------------------------------------------------------------ streams


class HostToDeviceStream:
    def __init__(self, shape: Sequence[int], dtype_: dtype, name: str):
        self.shape = tuple(shape)
        self.dtype = dtype_
        self.tensor_id = name

    def __repr__(self) -> str:
        return f"HostToDeviceStream[{self.tensor_id} {self.dtype} {self.shape}]"


class DeviceToHostStream(HostToDeviceStream):
    def __repr__(self) -> str:
        return f"DeviceToHostStream[{self.tensor_id} {self.dtype} {self.shape}]"


def h2d_stream(shape: Sequence[int], dtype: dtype, name: Optional[str] = None
               ) -> HostToDeviceStream:
    """``popxl.h2d_stream`` (streams.py)."""
    return HostToDeviceStream(shape, dtype, name or "h2d")


def d2h_stream(shape: Sequence[int], dtype: dtype, name: Optional[str] = None
               ) -> DeviceToHostStream:
    """``popxl.d2h_stream`` (streams.py)."""
    return DeviceToHostStream(shape, dtype, name or "d2h")


# ------------------------------------------------------------------------------------ session


class Session:
    """``popxl.Session`` (popart: python/popxl/python_files/session.py, docs/popxl/session.rst).

    Holds the variables' values; ``run`` executes the main graph once. With
    ``ir.num_host_transfers`` n > 1, every input array has a leading dimension n and the k-th
    ``host_load`` of a stream reads row k; outputs are stacked the same way."""

    def __init__(self, ir: Ir, device_desc: str = "cpu"):
        if device_desc not in ("ipu_hw", "ipu_model", "cpu"):
            raise ValueError(f"unknown device_desc {device_desc!r}")
        self.ir = ir
        self.device_desc = device_desc
        self._variables = {v: v.data.clone() for v in ir._variables}
        self.keep_values = False
        self.values: Dict[Tensor, torch.Tensor] = {}
        self.is_attached = False
        self._loads: Dict[HostToDeviceStream, int] = {}
        for op in ir.main_graph._ops:
            if op.stream is not None:
                self._loads[op.stream] = self._loads.get(op.stream, 0) + 1

    def __enter__(self) -> Session:
        self.is_attached = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.is_attached = False

    def expected_inputs(self) -> List[HostToDeviceStream]:
        return list(self._loads)

    def run(self, inputs: Optional[Dict[HostToDeviceStream, np.ndarray]] = None
            ) -> Dict[DeviceToHostStream, np.ndarray]:
        if not self.is_attached:  # session.py: runtime functions need the device
            raise ValueError("Must be attached to device before calling a runtime function: "
                             "run inside `with session:`")
        inputs = inputs or {}
        if set(inputs) != set(self._loads):
            raise ValueError(f"expected inputs for {sorted(s.tensor_id for s in self._loads)}, "
                             f"got {sorted(s.tensor_id for s in inputs)}")
        transfers = self.ir.num_host_transfers
        batches: Dict[HostToDeviceStream, List[torch.Tensor]] = {}
        for stream, array in inputs.items():
            full = ((transfers,) if transfers > 1 else ()) + stream.shape
            if tuple(np.shape(array)) != full:
                raise ValueError(f"{stream} needs an array of shape {full}, got "
                                 f"{np.shape(array)}")
            value = torch.from_numpy(np.array(array)).to(stream.dtype.torch_dtype)
            batches[stream] = list(value) if transfers > 1 else [value]
        run = Run(self._variables, batches, {} if self.keep_values else None)
        self.ir.main_graph._run(run, [])
        self.values = run.keep or {}
        return {stream: (torch.stack(values) if transfers > 1 else values[0]).numpy()
                for stream, values in run.stored.items()}

    def get_tensors_data(self, tensors: Sequence[Tensor]) -> Dict[Tensor, np.ndarray]:
        result: Dict[Tensor, np.ndarray] = {}
        for t in tensors:
            if isinstance(t, Variable):
                result[t] = self._variables[t].numpy().copy()
            elif isinstance(t, Constant):
                result[t] = t.data.numpy().copy()
            else:
                raise TypeError(f"{t} is neither a Variable nor a Constant")
        return result

    def get_tensor_data(self, tensor: Tensor) -> np.ndarray:  # noqa: F811 (PopXL's name)
        return self.get_tensors_data([tensor])[tensor]

    def write_variables_data(self, tensors: Dict[Variable, np.ndarray]) -> None:
        for t, data in tensors.items():
            if not isinstance(t, Variable):
                raise TypeError(f"{t} is not a Variable: only variables can be written")
            if isinstance(data, numbers.Number):  # session.py: a number takes the dtype
                if t.dtype.fp8 is not None:
                    raise TypeError(f"FP8 data for {t} must be cast with "
                                    "host_pow2scale_cast_to_fp8 first")
                value = torch.tensor(data, dtype=t.dtype.torch_dtype)
            else:
                value = torch.from_numpy(np.array(data))
            if value.dtype != t.dtype.torch_dtype:
                raise TypeError(f"{t} needs {t.dtype} data, got {value.dtype}")
            if tuple(value.shape) != t.shape:
                raise ValueError(f"{t} needs data of shape {t.shape}, got {tuple(value.shape)}")
            self._variables[t] = value

    def write_variable_data(self, tensor: Variable,  # noqa: F811 (PopXL's name)
                            data: np.ndarray) -> None:
        self.write_variables_data({tensor: data})

