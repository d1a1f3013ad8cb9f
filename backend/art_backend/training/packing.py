"""A step's sequences packed as prefix trees, so that what several share is computed once.

The rollouts of a group repeat their head (system prompt, tool definitions, question), and the
groups of one task share most of it too. A packed row is a prefix tree of sequences flattened
depth first: each token appears once for all the sequences that pass through it, attends to the
tokens on its path from the root (exactly the context it had when sampled) and sits at its
position in those sequences, so its logits are the unpacked ones. A token predicts the next
token of every sequence through it: a shared token followed by different continuations carries
one loss term per continuation, each with its own sequence's advantage, weight and rollout
logprob. The LoRA's effect on the shared keys and values reaches every continuation through
the one copy, so the gradients are exactly the unpacked batch's.

Sequences share a tree only where that pays: a token attends over its whole row, so merging
saves the shared tokens but lengthens the row (see `_merging_pays`); sequences that share
nothing (random batches) keep rows of their own. Rows are then batched, padded, as many as fit
the token budget:

    for batch in pack(sequences, max_tokens):
        logits = model(input_ids=batch.token_ids, position_ids=batch.positions,
                       attention_mask=batch.attention_bias(dtype)).logits    # [B, L, vocab]
        logp_new = log_softmax(logits / T)[batch.term_rows, batch.term_positions, batch.term_targets]

(On CPU the trainer computes that masked attention per segment of the tree: tree_attention.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from art_backend.training.tokenize import TrainSequence

T = TypeVar("T")


@dataclass
class _Node:
    token: int
    position: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    index: int = -1  # where the token sits in its row, once flattened


@dataclass
class PackedBatch:
    """Prefix-tree rows padded to one length (padding: token 0, attending to itself only)."""

    token_ids: Tensor  # [B, L]
    positions: Tensor  # [B, L]: each token's position in its sequences
    parents: list[list[int]]  # per row, each token's predecessor on its path (-1: none); parents come first
    # one loss term per trained token of every sequence: the row and position of the token whose
    # logits predict it, the predicted token, and its sequence's rollout logprob, advantage and weight
    term_rows: Tensor
    term_positions: Tensor
    term_targets: Tensor
    term_rollout_logprobs: Tensor
    term_advantages: Tensor
    term_weights: Tensor  # each a share of the step's loss (`accumulate_gradients` divides by the total)
    term_sequences: Tensor  # which of the batch's sequences the term is of (a sequence-level ratio's)

    @property
    def tokens(self) -> int:
        """Tokens computed, padding included."""
        return self.token_ids.numel()

    def attention_bias(self, dtype: torch.dtype) -> Tensor:
        """[B, 1, L, L]: 0 where a token may attend (its path from the root, itself included), the
        dtype's lowest value elsewhere (a float mask: every attention implementation adds it)."""
        rows, length = self.token_ids.shape
        allowed = torch.eye(length, dtype=torch.bool).repeat(rows, 1, 1)
        for row, parents in enumerate(self.parents):
            for index, parent in enumerate(parents):
                if parent >= 0:
                    allowed[row, index] |= allowed[row, parent]
        return torch.zeros(rows, 1, length, length, dtype=dtype).masked_fill_(~allowed[:, None],
                                                                              torch.finfo(dtype).min)


@dataclass
class _Tree:
    root: dict[int, _Node] = field(default_factory=dict)
    members: list[tuple[int, list[_Node]]] = field(default_factory=list)  # (sequence, its path)
    size: int = 0


def _sharing_order(sequences: list[TrainSequence]) -> list[int]:
    """Sequences sorted by their tokens, so neighbours share the longest prefixes."""
    return sorted(range(len(sequences)), key=lambda i: sequences[i].token_ids)


def _path_cost(root: dict[int, _Node], tokens: list[int]) -> int:
    """How many of `tokens` a tree does not hold yet."""
    children, shared = root, 0
    for token in tokens:
        node = children.get(token)
        if node is None:
            break
        shared += 1
        children = node.children
    return len(tokens) - shared


# The row length at which a token's attention (over its row) costs about what the rest of its
# forward and backward costs: set from bench-training's rows on the 135M model on CPU, where
# the masked attention runs unfused. Longer rows pay more per token.
ATTENTION_SPAN = 1024


def _row_cost(length: int) -> float:
    return length + length * length / ATTENTION_SPAN


def _merging_pays(tree_size: int, new_tokens: int, length: int) -> bool:
    """Whether a sequence of `length` tokens, `new_tokens` of them not yet in a tree of
    `tree_size`, is cheaper inside the tree than in a row of its own."""
    return _row_cost(tree_size + new_tokens) < _row_cost(tree_size) + _row_cost(length)


def _insert(root: dict[int, _Node], tokens: list[int]) -> list[_Node]:
    path: list[_Node] = []
    children, parent = root, None
    for position, token in enumerate(tokens):
        node = children.get(token)
        if node is None:
            node = children[token] = _Node(token, position, parent)
        path.append(node)
        children, parent = node.children, node
    return path


def pack(sequences: list[TrainSequence], max_tokens: int) -> list[PackedBatch]:
    """`sequences` as prefix trees of at most `max_tokens` tokens each (a longer sequence gets a
    tree of its own), their rows batched so a batch holds at most `max_tokens` padded tokens."""
    trees: list[_Tree] = []
    for i in _sharing_order(sequences):
        tokens = sequences[i].token_ids
        new = _path_cost(trees[-1].root, tokens) if trees else len(tokens)
        if not trees or trees[-1].size + new > max_tokens or not _merging_pays(trees[-1].size, new, len(tokens)):
            trees.append(_Tree())
            new = len(tokens)
        trees[-1].size += new
        trees[-1].members.append((i, _insert(trees[-1].root, tokens)))
    return [_flatten(batch, sequences) for batch in padded_batches(trees, lambda t: t.size, max_tokens)]


def padded_batches(items: list[T], length: Callable[[T], int], budget: int) -> list[list[T]]:
    """`items` longest first, as many per batch as fit `budget` tokens once each is padded to its
    batch's first (longest); a longer item gets a batch of its own."""
    batches: list[list[T]] = []
    for item in sorted(items, key=length, reverse=True):
        if batches and length(batches[-1][0]) * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


def _flatten(trees: list[_Tree], sequences: list[TrainSequence]) -> PackedBatch:
    """Each tree depth first (so a token's path comes before it) as one row, padded."""
    length = trees[0].size
    token_ids = torch.zeros(len(trees), length, dtype=torch.long)
    positions = torch.zeros(len(trees), length, dtype=torch.long)
    parents: list[list[int]] = []
    terms: list[tuple[int, int, int, int, float, float, float]] = []
    for row, tree in enumerate(trees):
        nodes: list[_Node] = []
        stack = list(reversed(tree.root.values()))
        while stack:
            node = stack.pop()
            node.index = len(nodes)
            nodes.append(node)
            stack.extend(reversed(node.children.values()))
        token_ids[row, :len(nodes)] = torch.tensor([n.token for n in nodes])
        positions[row, :len(nodes)] = torch.tensor([n.position for n in nodes])
        parents.append([n.parent.index if n.parent else -1 for n in nodes])
        for i, path in tree.members:
            sequence = sequences[i]
            terms += [(row, path[t - 1].index, sequence.token_ids[t], i, sequence.logprobs[t], sequence.advantage,
                       sequence.weight) for t in range(1, len(path)) if sequence.assistant_mask[t]]
    columns = list(zip(*terms)) if terms else [()] * 7
    rows, term_positions, targets, of_sequence = (torch.tensor(c, dtype=torch.long) for c in columns[:4])
    return PackedBatch(token_ids, positions, parents, rows, term_positions, targets,
                       *(torch.tensor(c, dtype=torch.float) for c in columns[4:]), of_sequence)
