"""A stage's backward in two passes over one autograd graph: I (input gradient) now, W (weight gradients) later.

Zero-bubble schedules send I's result to the previous stage at once and run W where the pipeline would idle.
I runs the engine from the stage output to the stage input only. The graph's nodes then fall in two parts:
those on a path to the input (I runs them) and the weight-only rest. A "split" node sits on an input path
and also feeds the weight-only part (a linear's matmul, a norm, a bias add): I records the gradient that
reaches it, and W re-enters the graph there, asking the engine for the weights only, so no input-gradient
work is done twice. The engine skips a built-in node's unneeded outputs itself; Python Functions holding
weights are told which half to compute on their own nodes (``gradient_pass``). Split nodes that share weights
(Domino's μ-chunks use the same matrices) form one group and one engine call, so each weight's gradient
accumulates once per W: the post-accumulate hooks of the DP gradient buffers fire as in an unsplit backward.

Domino: unsplit, a column-parallel linear's input-gradient all-reduce overlaps the linear's own weight
gradient. In I the other μ-chunks' I hides it, except for the all-reduce waited for last, which I would
wait for idle: so I computes that linear's weight gradient (its group, taken out of W) while this last
all-reduce flies, then waits. I still returns, and the pipeline sends, the reduced gradient, held up by
one weight gradient at most (running a whole W before the send would hold it up by all of W).

A stage without an input (the first) has nothing for I to send: its whole backward runs as W.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..tensor_parallel.async_comm import WaitForInputGradient, gradient_pass


def run_backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """The whole backward from an output whose data may have been released (torch.autograd.backward
    checks shapes)."""
    if grad is None:
        grad = torch.ones_like(output)
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


@dataclass
class WeightGradients:
    """What W needs: per group of split nodes, the gradients recorded at them and the weights they reach."""

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    whole: tuple | None = None  # (output, grad): a stage without an input runs its whole backward as W
    # the stage output, kept until W: its graph's custom-Function nodes must stay alive for W's edges (torch
    # 2.11 invalidates a Function node whose output is gone; the output's data was already released)
    graph: torch.Tensor | None = None


def _graph(root) -> list:
    """Every node reachable from ``root``, each after all nodes it reaches (children first)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack += [(child, False) for child, _ in node.next_functions if child is not None]
    return order


def _find_split(root, input_node) -> tuple[list, dict, dict]:
    """(split nodes, weight-only subgraph leaves per split node, Domino's input-gradient waits -> their linear)."""
    nodes = _graph(root)
    on_input = {}
    for node in nodes:
        on_input[node] = node is input_node or any(on_input.get(c, False) for c, _ in node.next_functions)
    split, leaves = [], {}
    for node in nodes:
        if not on_input[node]:
            continue
        weight_children = [c for c, _ in node.next_functions if c is not None and not on_input[c]]
        if weight_children:
            split.append(node)
            found = [n for child in weight_children for n in _graph(child) if hasattr(n, "variable")]
            leaves[node] = found
    waits = {c: node for node in split for c, _ in node.next_functions
             if isinstance(c, WaitForInputGradient._backward_cls)}
    return split, leaves, waits


def _group(split: list, leaves: dict) -> list[list]:
    """Split nodes joined when they reach a common weight (union-find over the leaves)."""
    parent = {node: node for node in split}

    def find(node):
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    owner = {}
    for node in split:
        for leaf in leaves[node]:
            if leaf in owner:
                parent[find(node)] = find(owner[leaf])
            else:
                owner[leaf] = node
    groups = {}
    for node in split:
        groups.setdefault(find(node), []).append(node)
    return list(groups.values())


def backward_input(output: torch.Tensor, grad: torch.Tensor | None,
                   stage_input: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightGradients]:
    """I: the gradient of ``stage_input`` (None without one), and what W needs to finish the backward."""
    if grad is None:
        grad = torch.ones_like(output)
    if stage_input is None or output.grad_fn is None:
        return None, WeightGradients(whole=(output, grad))
    input_node = get_gradient_edge(stage_input).node
    split, leaves, waits = _find_split(output.grad_fn, input_node)
    groups, recorded, early, waited = _group(split, leaves), {}, [], []

    def before_wait(node):
        """Before the last wait, its linear's weight gradient (once every node of its group has run)."""
        waited.append(node)
        group = next(g for g in groups if waits[node] in g)
        if len(waited) == len(waits) and all(n in recorded for n in group):
            early.append(group)
            _weight_pass(_pending([group], recorded, leaves))

    hooks = [node.register_prehook(lambda grads, node=node: recorded.__setitem__(node, grads)) for node in split]
    hooks += [node.register_prehook(lambda grads, node=node: before_wait(node)) for node in waits]
    try:
        with gradient_pass(split, inputs=True, weights=False):
            (input_grad,) = Variable._execution_engine.run_backward(
                (output,), (grad,), True, False, (stage_input,), True, False)
    finally:
        for hook in hooks:
            hook.remove()
    pending = _pending([g for g in groups if not any(g is e for e in early)], recorded, leaves)
    pending.graph = output
    return input_grad, pending


def _pending(groups: list[list], recorded: dict, leaves: dict) -> WeightGradients:
    """What W needs for ``groups``: the gradients recorded at their nodes and the weights they reach."""
    pending = WeightGradients()
    for group in groups:
        edges, grads = [], []
        for node in group:
            for index, g in enumerate(recorded.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(g)
        weights = list({id(leaf.variable): leaf.variable for node in group for leaf in leaves[node]}.values())
        if edges:
            pending.groups.append((edges, grads, weights))
    return pending


def _weight_pass(pending: WeightGradients) -> None:
    """The weights-only engine calls, one per group (the group's weights accumulate once)."""
    entries = [edge.node for edges, _, _ in pending.groups for edge in edges]
    with gradient_pass(entries, inputs=False, weights=True):
        for edges, grads, weights in pending.groups:
            torch.autograd.backward(edges, grads, inputs=weights)


def backward_weight(pending: WeightGradients) -> None:
    """W: the weight gradients, accumulated into ``.grad`` (post-accumulate hooks fire as usual)."""
    if pending.whole is not None:
        run_backward(*pending.whole)
        return
    _weight_pass(pending)
