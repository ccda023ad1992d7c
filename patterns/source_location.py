"""Where a graph node came from, in one format for every site: the nn.Module path and the source line.

    model.layers.3.self_attn at modeling_llama.py:258     (module path from nn_module_stack)
    softmax at quickstart.py:32                            (no module: the node's name)
"""
from __future__ import annotations

import re
from typing import Optional

import torch.fx as fx

# Dynamo names module paths after the frame's local that held the root module: L['self'].layers.0,
# L['args'][0].model.layers.0, L['fn'].block ... The user knows the module as the root's attributes.
_ROOT = re.compile(r"^L\[[^\]]*\](\[[^\]]*\])*\.?")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def module_path(node: fx.Node) -> Optional[str]:
    """The innermost nn.Module the node was traced in, as a dotted path from the root (None at the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    if not isinstance(path, str):
        return None
    path = _ROOT.sub("", path).replace("['", ".").replace("']", "").replace("[", ".").replace("]", "").strip(".")
    path = ("." + path).replace("._modules.", ".").strip(".")
    return path or None


def source_line(node: fx.Node) -> Optional[str]:
    """`file.py:line` of the innermost frame Dynamo recorded for the node (None without a stack trace)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    file, line = frames[-1]
    return f"{file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}"


def location(node: fx.Node) -> str:
    """`<module path, else node name> at <file>:<line>`, or the first part alone without a stack trace."""
    who = module_path(node) or node.name
    line = source_line(node)
    return f"{who} at {line}" if line else who
