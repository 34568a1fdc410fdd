"""The IR: typed tensors with symbolic dims, ops with numpy references, the Graph."""
from kiln.graph.dtype import DType, from_numpy, to_numpy  # noqa: F401
from kiln.graph.graph import Graph, GraphError  # noqa: F401
from kiln.graph.op import Node, OpDef, OpRegistry  # noqa: F401
from kiln.graph.ops import OPS  # noqa: F401
from kiln.graph import gdn_ops  # noqa: F401,E402  (registers the hybrid models' ops into OPS)
from kiln.graph import moe_ops  # noqa: F401,E402  (registers the mixture-of-experts ops into OPS)
from kiln.graph import fp8_ops  # noqa: F401,E402  (registers the FP8 W8A8 ops into OPS)
from kiln.graph import gguf_ops  # noqa: F401,E402  (registers linear_gguf, GGUF blocks computed in, into OPS)
from kiln.graph import nvfp4_ops  # noqa: F401,E402  (registers the NVFP4 W4A16 linear into OPS)
from kiln.graph import collective_ops  # noqa: F401,E402  (registers the tensor-parallel ops into OPS)
from kiln.graph.tensor import Dim, Tensor, TensorKind  # noqa: F401
