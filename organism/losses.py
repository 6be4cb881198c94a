"""Training-only heads and auxiliary losses of the organism VLMs.

The patch head teaches the vision tower each patch's category and place (`patch_loss`). The
other losses spell out the circuits a 4-layer LM trained from scratch does not find alone: the
copy head (`copy_loss`), the relation hops (`relation_loss`) and the caption pointer
(`pointer_loss`); the deep model's `hop_loss` places the read of the hop-2 object in layers >= 2.
None of these heads is saved with the model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .questions import IGNORE
from .scenes import CATEGORIES, POPULARITY, RELATIONS


class PatchHead(nn.Module):
    """Per-patch classifier on tower features: category (C+1 with background), row, column."""

    def __init__(self, hidden: int, grid: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.category = nn.Linear(hidden, len(CATEGORIES) + 1)
        self.row = nn.Linear(hidden, grid)
        self.col = nn.Linear(hidden, grid)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.norm(feats)  # [B, N, D]
        return self.category(h), self.row(h), self.col(h)


def patch_weights(balance: float) -> torch.Tensor:
    """Class weights of `patch_loss`, background first: 0.3 for the background, and each
    category popularity ** -balance (mean 1), so that rare categories weigh more."""
    rare = torch.from_numpy(POPULARITY).float() ** -balance
    return torch.cat([torch.tensor([0.3]), rare / rare.mean()])


def patch_loss(
    category: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """Dense loss of the patch head's outputs (`category`: `[B, N, C + 1]`, `row` and `col`:
    `[B, N, grid]`, patches in raster order): weighted cross-entropy of each patch's category
    against the exact-mask `labels` (`[B, N]`, 0 = background), plus 0.2 x the cross-entropy of
    its own row and column."""
    g = row.shape[-1]
    rows = torch.arange(g).repeat_interleave(g)
    cols = torch.arange(g).repeat(g)
    loss_cat = nn.functional.cross_entropy(
        category.flatten(0, 1), labels.flatten(), weight=weight, ignore_index=IGNORE
    )
    b = labels.shape[0]
    loss_pos = nn.functional.cross_entropy(
        row.flatten(0, 1), rows.repeat(b)
    ) + nn.functional.cross_entropy(col.flatten(0, 1), cols.repeat(b))
    return loss_cat + 0.2 * loss_pos


# the heads the auxiliary losses supervise (copy: in the later half of the layers; the others in
# layer 1; the two-hop anchor head in the layer before the first hop layer, the hop head in the
# hop layers), distinct so that the circuits do not share a head
COPY_HEAD, RELATION_HEAD, POINTER_HEAD, HOP_ANCHOR_HEAD, HOP_HEAD = 0, 1, 2, 3, 4


class RelationProbe(nn.Module):
    """Training-only linear read-outs of positions and of the relation asked from the LM's
    residual stream."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.grid = nn.Linear(hidden, 2)  # an image token's own place, at the circuit's first layer
        self.place = nn.Linear(hidden, 2)  # a category token's own object, after that layer
        self.carry = nn.Linear(hidden, 2)  # the first object's, at the second token, a layer later
        self.word = nn.Linear(hidden, len(RELATIONS))  # the relation asked, there too


def relation_loss(
    probe: RelationProbe,
    hidden_states: tuple[torch.Tensor, ...],
    attentions: tuple[torch.Tensor, ...],
    places: torch.Tensor,
    relations: torch.Tensor,
    image: torch.Tensor,
    image_places: torch.Tensor | None = None,
    layer: int = 0,
) -> dict[str, torch.Tensor]:
    """Supervise the two-hop circuit a relation question needs, one hop per layer from `layer`:
    - the image tokens hold their own place at the input of `layer` (`image`: `[B, S]` bool;
      `image_places`: `[N, 2]` x, y in [-1, 1] of the N image tokens in sequence order, by
      default each row's square grid in raster order); a projector trained for presence alone
      drops it;
    - after `layer`, each category token that names an object holds that object's centre
      (`places`: row, position, x, y), as the `where` task needs;
    - in layer `layer + 1`, head 1 attends from a relation's second category token to its first
      (`relations`: row, second, first, first object's x, y, relation index), and
    - after that layer the second token holds the first object's centre and the relation asked,
      so the later layers only compare two centres. Without these hops the relation answer
      stayed at chance in every run; with the centres alone the second token did not know
      which relation was asked, and the answer stayed at chance too.

    The LLaVA organisms start at layer 0: their projected tokens carry the tower's absolute
    positions. A Qwen2.5-VL tower has only relative ones, so organism-qwen's image tokens learn
    their place in layer 0 from M-RoPE, against the vision-start token, and the hops start at
    layer 1. Returns the terms by name (`grid`, `place`, `relation_attention`, `carry`, `word`);
    the loss is their sum."""
    terms = {}
    if image_places is None:
        n_visual = int(image[0].sum())
        g = math.isqrt(n_visual)
        k = torch.arange(n_visual)
        patch = torch.stack([k % g, k // g], 1).float() * (2 / (g - 1)) - 1
        image_places = patch.repeat(len(image), 1)
    if len(image_places):
        own = probe.grid(hidden_states[layer][image].float())
        terms["grid"] = nn.functional.mse_loss(own, image_places)
    if len(places):
        rows, pos = places[:, 0].long(), places[:, 1].long()
        h = hidden_states[layer + 1][rows, pos].float()
        terms["place"] = nn.functional.mse_loss(probe.place(h), places[:, 2:])
    if len(relations):
        rows, second, first = (relations[:, i].long() for i in range(3))
        att = attentions[layer + 1][rows, RELATION_HEAD, second, first].float().clamp(min=1e-12)
        h = hidden_states[layer + 2][rows, second].float()
        terms["relation_attention"] = -att.log().mean()
        terms["carry"] = nn.functional.mse_loss(probe.carry(h), relations[:, 3:5])
        terms["word"] = nn.functional.cross_entropy(probe.word(h), relations[:, 5].long())
    return terms


def pointer_loss(
    attentions: tuple[torch.Tensor, ...], targets: torch.Tensor, masks: torch.Tensor
) -> torch.Tensor:
    """Mean -log of the attention mass that head 2 of layer 1 puts, from the token before each
    object a caption names, on that object's patches (`targets`: row, position, first image
    token; `masks`: `[M, n_visual]`). It teaches the caption to find its next object in the
    image rather than to guess it from the words so far."""
    rows, q, start = targets.unbind(1)
    cols = start[:, None] + torch.arange(masks.shape[1])
    att = attentions[1][rows, POINTER_HEAD, q].gather(1, cols).float()
    return -(att * masks).sum(1).clamp(min=1e-12).log().mean()


class HopProbe(nn.Module):
    """Training-only linear read-outs, at a two-hop question's answer position, of the anchor's
    centre and of the direction asked."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.carry = nn.Linear(hidden, 2)
        self.word = nn.Linear(hidden, len(RELATIONS))


def hop_loss(
    probe: HopProbe,
    hidden_states: tuple[torch.Tensor, ...],
    attentions: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    masks: torch.Tensor,
    layers: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    """Supervise the two-hop circuit ("What colour is the shape left of the red_circle?") so that
    the hop-2 object is read from the image late, at the answer position q:
    - the anchor's category token holds the anchor's centre after layer 0 (the `place` term of
      `relation_loss`, from the position targets);
    - in layer `layers[0] - 1`, HOP_ANCHOR_HEAD attends from q to the anchor token
      (`hop_anchor_attention`), and after that layer q holds the anchor's centre (`hop_carry`)
      and the direction asked (`hop_word`);
    - in each layer of `layers`, HOP_HEAD puts its attention mass, from q, on the hop-2 object's
      patches (`hop_read`: mean -log mass).

    `targets`: row, q, anchor position, anchor x, y (in [-1, 1]), relation index, first image
    token; `masks`: `[M, n_visual]` patches of each question's hop-2 object. Layers beyond the
    model's are skipped. Returns the terms by name; the loss is their sum."""
    rows, q, anchor = (targets[:, i].long() for i in range(3))
    start = targets[:, 6].long()
    n_layers = len(attentions)
    reads = [layer for layer in layers if 0 < layer < n_layers]
    if not reads:
        raise ValueError(f"hop layers={layers}; the model has {n_layers} layers (use 1..L-1)")
    carry_layer = reads[0] - 1
    att = attentions[carry_layer][rows, HOP_ANCHOR_HEAD, q, anchor].float().clamp(min=1e-12)
    h = hidden_states[carry_layer + 1][rows, q].float()
    cols = start[:, None] + torch.arange(masks.shape[1])
    mass = [
        (attentions[layer][rows, HOP_HEAD, q].gather(1, cols).float() * masks).sum(1)
        for layer in reads
    ]
    return {
        "hop_anchor_attention": -att.log().mean(),
        "hop_carry": nn.functional.mse_loss(probe.carry(h), targets[:, 3:5]),
        "hop_word": nn.functional.cross_entropy(probe.word(h), targets[:, 5].long()),
        "hop_read": -torch.stack(mass).clamp(min=1e-12).log().mean(),
    }


def copy_loss(attentions: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
    """Mean -log attention of head 0 in the later half of the layers, from each one-turn chat
    row's last prompt position to its question's last category token (`targets`: row, q, k).

    The category token computes the answer (category-last form); this teaches one head to carry
    it to the position that answers, the step a from-scratch LM otherwise finds late."""
    rows, q, k = targets.unbind(1)
    later = attentions[max(1, len(attentions) // 2) :]
    terms = [att[rows, COPY_HEAD, q, k].float().clamp(min=1e-12).log() for att in later]
    return -torch.stack(terms).mean()


def look_loss(attention: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor, head: int):
    """Mean -log attention mass of `head` (`attention`: one layer's `[B, H, S, S]` map) from
    each question's category token to the tokens of the object it names (`targets`: row, q,
    first image token; `masks` as in `read_hop_loss`): the lookup a hybrid decoder, whose
    early layers have no attention to supervise, does in its first full-attention layer."""
    rows, q, start = targets.long().unbind(1)
    cols = (start[:, None] + torch.arange(masks.shape[1])).clamp(max=attention.shape[-1] - 1)
    mass = (attention[rows, head, q].gather(1, cols).float() * masks).sum(1)
    return -mass.clamp(min=1e-12).log().mean()


def read_hop_loss(
    probe: HopProbe,
    hidden_states: tuple[torch.Tensor, ...],
    attention: torch.Tensor,
    targets: torch.Tensor,
    masks: torch.Tensor,
    layer: int,
    head: int = HOP_HEAD,
) -> dict[str, torch.Tensor]:
    """`hop_loss` for a decoder whose only attention maps are those of some layers (Qwen3.5's
    full-attention layers between Gated-DeltaNet ones): the answer position q holds the anchor's
    centre (`hop_carry`) and the direction asked (`hop_word`) at the input of `layer`, and there
    `head` puts its mass, from q, on the hop-2 object's tokens (`hop_read`; `attention`: that
    layer's `[B, H, S, S]` map). How q learns the anchor (a recurrent layer has no attention to
    supervise) is left to the earlier layers. `targets` and `masks` as in `hop_loss`, the masks
    zero past each image's tokens."""
    rows, q = targets[:, 0].long(), targets[:, 1].long()
    start = targets[:, 6].long()
    cols = (start[:, None] + torch.arange(masks.shape[1])).clamp(max=attention.shape[-1] - 1)
    mass = (attention[rows, head, q].gather(1, cols).float() * masks).sum(1)
    h = hidden_states[layer][rows, q].float()
    return {
        "hop_carry": nn.functional.mse_loss(probe.carry(h), targets[:, 3:5]),
        "hop_word": nn.functional.cross_entropy(probe.word(h), targets[:, 5].long()),
        "hop_read": -mass.clamp(min=1e-12).log().mean(),
    }
