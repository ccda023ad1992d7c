"""Walking forward from a softmax to its P·V: casts and dropout only, nothing else reading the
probabilities (the "forward" step of find_sites)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..canonicalize import dropout_args, exp_sum_of, is_finite_number, kind, log_softmax_of
from ..layout import Contraction, contraction, identity
from ..site import PassOptions
from .scores import Miss, _describe, _regroups_batch


@dataclass
class Probs:
    end: fx.Node  # the tensor that enters P·V
    pv: Contraction
    dropout_p: float = 0.0
    nodes: list = field(default_factory=list)  # softmax .. end


def _leaves_graph(gm: Optional[fx.GraphModule], node: fx.Node) -> str:
    """Why probabilities that are an output of the graph stay eager's: Dynamo's graph ends at a graph
    break after them (the P·V product that reads them, if any, is in the graph after the break), or the
    caller receives them (HF's output_attentions=True returns every layer's weights)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        why = str(getattr(reason, "reason", "") or "").strip().splitlines()
        stack = getattr(reason, "user_stack", None) or []
        at = f" at {stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}" if stack else ""
        return (f"the probabilities leave the graph at a graph break ({why[0] if why else 'unknown reason'}{at}): "
                "the P·V product that reads them is traced in another graph, so softmax and P·V cannot be fused "
                "here; removing the graph break between them lets the site be rewritten")
    outs = [a for a in torch.utils._pytree.tree_leaves([u.args for u in node.users if u.op == "output"])]
    idx = next((i for i, a in enumerate(outs) if a is node), None)
    which = f" as output {idx} of the compiled graph" if idx is not None else ""
    if all(u.op == "output" for u in node.users):
        return (f"the probabilities are returned to the caller{which} and no P·V contraction reads them in this "
                "graph: nothing to fuse")
    return ("probabilities are also returned to the caller (output_attentions): the graph returns them"
            f"{which} besides the P·V product, so the attention weights eager computes are needed and the site "
            "is left as written")


def walk_probs(sm: fx.Node, options: PassOptions, gm: Optional[fx.GraphModule] = None,
               through: Optional[fx.Node] = None) -> Probs:
    lsm = log_softmax_of(sm)  # exp(log_softmax(s)): both nodes are the softmax
    if lsm is not None and len(lsm.users) != 1:
        names = ", ".join(u.name for u in lsm.users if u is not sm)
        raise Miss(f"the log-probabilities are also read by {names}; only the exp to the probabilities may read them")
    es = exp_sum_of(sm)  # exp(y) / Σ exp(y), y = s - rowmax(s): the exp, its sum and the division are the softmax
    if es is not None:
        e, den = es
        if set(e.users) != {den, sm} or set(den.users) != {sm}:
            names = ", ".join(u.name for n in (e, den) for u in n.users if u not in (den, sm))
            raise Miss(f"the exponentiated scores or their row sums are also read by {names}; only the softmax's own "
                       "division may read them")
    pre = [lsm] if lsm is not None else (list(es) if es is not None else [])
    cur, nodes, dropout_p = sm, pre + [sm], 0.0
    for _ in range(32):
        users = list(cur.users)
        if any(u.op == "output" for u in users):
            raise Miss(_leaves_graph(gm, cur))
        if len(users) != 1:
            names = ", ".join(u.name for u in users)
            raise Miss(f"probabilities have {len(users)} users ({names}); only a P·V contraction may read them")
        u = users[0]
        k = kind(u)
        if (k in ("cast", "identity") or (k == "reshape" and _regroups_batch(u))) and u.args[0] is cur:
            cur = u
        elif u is through:  # the sink column dropped (patterns/sinks.py)
            cur = u
        elif k == "dropout" and u.args[0] is cur:
            _, p, training = dropout_args(u)
            if training is False:  # the identity whatever p is (a module's p is a run-time value under dynamic=True)
                cur = u
                nodes.append(cur)
                continue
            if not isinstance(training, bool):
                raise Miss("dropout with a non-constant training flag")
            if not is_finite_number(p):
                raise Miss("dropout in training with a run-time p (dynamic=True makes a module's float attribute a "
                           "graph input); the op's p is a constant")
            if not 0 <= p <= 1:
                raise Miss(f"dropout with p={p} outside [0, 1] (eager raises)")
            if training and p > 0:
                if dropout_p:
                    raise Miss("two dropouts on the probabilities")
                if not options.allow_training_dropout:
                    raise Miss("dropout on the probabilities in training (disabled by the options)")
                if p >= 1:
                    raise Miss("dropout with p >= 1")
                dropout_p = float(p)
            cur = u
        else:
            c = contraction(u)
            if c is None:
                raise Miss(f"probabilities feed {_describe(u)}, not a P·V contraction")
            if c.spelling == "baddbmm":
                raise Miss("probabilities enter a baddbmm")
            if c.spelling == "linear" and c.addend is not None:
                raise Miss("probabilities enter an F.linear that adds a bias")
            if c.lhs.node is not cur or c.rhs.node is cur:
                raise Miss("probabilities are not the left operand of the P·V contraction")
            if c.lhs.perm != identity(c.lhs.rank):
                raise Miss("probabilities enter the P·V contraction transposed")
            nodes.append(u)
            return Probs(cur, c, dropout_p, nodes)
        nodes.append(cur)
    raise Miss("probabilities chain too long")
