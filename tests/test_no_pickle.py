"""Nothing that can execute code when read travels on the wire or sits in the cache tiers.

1. A scan of the source of services/, engine/, kernels/ (the AST, so comments and strings
   do not count): no pickle-family module is imported, `torch.load` only with
   `weights_only=True`, `numpy.load` never with `allow_pickle=True`, no `torch.save`, and
   YAML only through its safe loader.
2. The KV wire format: a block's payload fields are exactly the tensors' raw bytes, and the
   message holds nothing but scalars and bytes (what the cache service and Redis store).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from google.protobuf.descriptor import FieldDescriptor

from rtp_serve.engine.outputs import PromptKV
from rtp_serve.services.common.pb import common_pb2
from rtp_serve.services.worker.kv_wire import split_blocks

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("services", "engine", "rtp_serve", "kernels")
# Modules whose loads run code from the data: pickle and everything built on it.
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve",
                  "joblib", "jsonpickle"}  # fmt: skip


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def violations(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            if name.split(".")[0] in BANNED_MODULES:
                found.append(f"{where}:{node.lineno}: imports {name}")
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func)
        bad = None
        if func == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            bad = "torch.load without weights_only=True"
        elif func == "torch.save":
            bad = "torch.save (a pickle)"
        elif func in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
            bad = "numpy.load(allow_pickle=True)"
        elif func in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
            bad = f"{func} (use yaml.safe_load)"
        elif func.endswith("read_pickle") or func.endswith("to_pickle"):
            bad = func
        if bad:
            found.append(f"{where}:{node.lineno}: {bad}")
    return found


def test_the_scan_catches_each_code_executing_format():
    source = "\n".join(
        [
            "import pickle",
            "from dill import loads",
            "import torch",
            "torch.load(f)",
            "torch.load(f, weights_only=True)",  # allowed
            "numpy.load(f, allow_pickle=True)",
            "numpy.load(f)",  # allowed
            "yaml.load(s)",
        ]
    )
    assert [v.split(": ", 1)[1] for v in violations(source, "x")] == [
        "imports pickle",
        "imports dill",
        "torch.load without weights_only=True",
        "numpy.load(allow_pickle=True)",
        "yaml.load (use yaml.safe_load)",
    ]


def test_no_code_executing_format_in_the_source():
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


def test_kv_blocks_are_raw_tensor_bytes_and_scalars():
    layers, tokens, heads, dim, block_size = 2, 20, 2, 4, 16
    k = torch.randn(layers, tokens, heads, dim)
    v = torch.randn(layers, tokens, heads, dim)
    blocks = split_blocks(PromptKV(0, k, v), block_size, [b"h" * 16])
    assert [b.num_tokens for b in blocks] == [16, 4]
    for block, start in zip(blocks, (0, 16), strict=True):
        end = start + block.num_tokens
        assert block.k == k[:, start:end].contiguous().numpy().tobytes()
        assert block.v == v[:, start:end].contiguous().numpy().tobytes()
    scalar_or_bytes = {
        FieldDescriptor.TYPE_BYTES,
        FieldDescriptor.TYPE_STRING,
        FieldDescriptor.TYPE_UINT32,
    }
    kinds = {f.name: f.type for f in common_pb2.KVBlock.DESCRIPTOR.fields}
    assert set(kinds.values()) <= scalar_or_bytes, kinds  # no nested message, no Any
