"""The attacks of the privacy benchmark (benchmarks/privacy.py), on what an honest-but-curious server
recorded: label inference (from the labels, the gradients a U-shaped device sends up, the head's
update the Fed Server receives, the label counts at a join) and input reconstruction (an inverse
network trained on auxiliary data), with the scores they are judged by (accuracy and AUC against
chance, SSIM and PSNR against a no-information baseline).

Every attack returns a :class:`LabelAttack`: a score per sample and class (higher: the attacker
believes more in that class), from which the accuracy (argmax) and the one-vs-rest AUC follow.
Where an attack needs one bit of truth to name its clusters or orient a binary score (the direction
and norm attacks), it takes the most favourable one, so its figure is an upper bound on what the
attacker achieves; the docs say which do (docs/split-privacy.md, "The privacy benchmark").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LabelAttack:
    """An attack's result: its scores per sample and class, judged against the true labels."""

    accuracy: float
    auc: float
    chance_accuracy: float   # the most frequent true class's share: what guessing it always scores
    samples: int

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "auc": self.auc, "chance_accuracy": self.chance_accuracy,
                "samples": self.samples}


def binary_auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` separating ``positive`` (bool) from the rest: the
    probability that a positive outscores a negative, ties counting half (Mann-Whitney); NaN when
    either side is empty."""
    scores = scores.double().flatten()
    positive = positive.bool().flatten()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # Tied scores share the mean of their ranks.
    unique, inverse = torch.unique_consecutive(sorted_scores, return_inverse=True)
    sums = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, ranks[order])
    counts = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(sorted_scores))
    ranks[order] = (sums / counts)[inverse]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def judge(scores: torch.Tensor, labels: torch.Tensor) -> LabelAttack:
    """An attack's ``scores`` (samples x classes) against the true ``labels``: accuracy of the
    argmax, the mean one-vs-rest AUC over the classes present with others beside them, and chance."""
    labels = labels.long().flatten()
    if scores.shape[0] != len(labels) or len(labels) == 0:
        raise ValueError(f"scores of {scores.shape[0]} samples for {len(labels)} labels")
    accuracy = float((scores.argmax(dim=1) == labels).double().mean())
    aucs = [binary_auc(scores[:, c], labels == c) for c in range(scores.shape[1])]
    present = [a for a in aucs if a == a]   # NaN: a class absent (or alone)
    counts = torch.bincount(labels, minlength=scores.shape[1])
    return LabelAttack(accuracy, sum(present) / len(present) if present else float("nan"),
                       float(counts.max()) / len(labels), len(labels))


def one_hot_scores(labels: torch.Tensor, classes: int) -> torch.Tensor:
    """The scores of an attacker that reads the labels themselves (plain split)."""
    return nn.functional.one_hot(labels.long().flatten(), classes).double()


def norm_attack(gradients: torch.Tensor, labels: torch.Tensor, classes: int) -> LabelAttack:
    """The norm attack (Li et al., arXiv 2102.08504; ExPLoit's starting point): a sample of the
    class the head fits worst sends up a larger gradient. A binary attack; for each class, the
    gradient's norm as the score of that class against the rest, oriented the better way (an upper
    bound: the attacker would have to guess the orientation). Scored as the best class's: its AUC,
    and its accuracy as a one-vs-rest decision at the threshold that best splits the two sides,
    against the larger side's share as chance."""
    norms = gradients.flatten(1).double().norm(dim=1)
    labels = labels.long().flatten()
    best: LabelAttack | None = None
    for c in range(classes):
        positive = labels == c
        auc = binary_auc(norms, positive)
        if auc != auc:
            continue
        score = norms if auc >= 0.5 else -norms
        result = LabelAttack(_best_threshold_accuracy(score, positive), max(auc, 1 - auc),
                             max(float(positive.double().mean()), 1 - float(positive.double().mean())), len(labels))
        if best is None or result.auc > best.auc:
            best = result
    if best is None:
        raise ValueError("the norm attack needs samples of at least two classes")
    return best


def _best_threshold_accuracy(score: torch.Tensor, positive: torch.Tensor) -> float:
    """The accuracy of ``score > t`` for the best threshold ``t`` (every side counted)."""
    order = torch.argsort(score, descending=True)
    hits = positive[order].double()
    # Calling the first k positive: k true positives counted, and every negative after them.
    true_pos = torch.cat([torch.zeros(1, dtype=torch.float64), hits.cumsum(0)])
    negatives_after = (1 - hits).sum() - torch.cat([torch.zeros(1, dtype=torch.float64), (1 - hits).cumsum(0)])
    return float(((true_pos + negatives_after) / len(score)).max())


def direction_attack(gradients: torch.Tensor, labels: torch.Tensor, classes: int, seed: int = 0,
                     iterations: int = 50) -> LabelAttack:
    """The direction attack (cosine clustering; Li et al.'s cosine attack, arXiv 2102.08504, and
    the clustering of arXiv 2203.05222): samples of one class send gradients pointing one way, so
    spherical k-means with ``classes`` clusters groups them. Each cluster is named by the true
    label most of its samples carry (an upper bound: one known label per cluster); a sample's score
    for a class is its cosine similarity to the centre of the cluster named so (the best one)."""
    unit = nn.functional.normalize(gradients.flatten(1).double(), dim=1)
    labels = labels.long().flatten()
    generator = torch.Generator().manual_seed(seed)
    k = min(classes, len(unit))
    # Farthest-point start: each new centre the sample least like those chosen (k-means++'s spirit,
    # deterministic past the first), so two classes rarely start in one cluster.
    chosen = [int(torch.randint(len(unit), (1,), generator=generator))]
    likeness = unit @ unit[chosen[0]]   # each sample's highest cosine to a chosen centre
    for _ in range(k - 1):
        chosen.append(int(likeness.argmin()))
        likeness = torch.maximum(likeness, unit @ unit[chosen[-1]])
    centres = unit[chosen].clone()
    for _ in range(iterations):
        assigned = (unit @ centres.T).argmax(dim=1)
        moved = torch.zeros_like(centres).index_add_(0, assigned, unit)
        empty = moved.norm(dim=1) == 0
        moved[empty] = centres[empty]
        centres = nn.functional.normalize(moved, dim=1)
    similarity = unit @ centres.T
    assigned = similarity.argmax(dim=1)
    scores = torch.full((len(unit), classes), -2.0, dtype=torch.float64)
    for cluster in range(k):
        members = labels[assigned == cluster]
        if len(members) == 0:
            continue
        name = int(torch.bincount(members, minlength=classes).argmax())
        scores[:, name] = torch.maximum(scores[:, name], similarity[:, cluster])
    return judge(scores, labels)


def similarity_scores(gradients: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """The similarity attack (arXiv 2203.05222, with the head the servers hold): under cross-entropy
    a linear head ``W`` sends up ``W^T (p - onehot(y))`` per sample, so the gradient of class ``c``
    at an uninformed prediction (``p`` uniform) is ``W^T (1/C - onehot(c))``. A sample's score for
    ``c`` is its gradient's cosine similarity to that reference (samples x classes, for
    :func:`judge`). Uses no truth: the head is in the global model the Fed Server sends every device."""
    weight = head_weight.double()
    classes = weight.shape[0]
    references = (torch.full((classes, classes), 1.0 / classes, dtype=torch.float64)
                  - torch.eye(classes, dtype=torch.float64)) @ weight          # classes x features
    unit = nn.functional.normalize(gradients.flatten(1).double(), dim=1)
    return unit @ nn.functional.normalize(references, dim=1).T


def distribution_scores(per_device: list[torch.Tensor]) -> torch.Tensor:
    """Devices x classes of a device-level attack's evidence, each row centred: a score over its
    mean says the attacker believes the class over-represented on that device."""
    rows = torch.stack([row.double() for row in per_device])
    return rows - rows.mean(dim=1, keepdim=True)


def device_level(scores: torch.Tensor, true_counts: torch.Tensor) -> LabelAttack:
    """A device-level attack (the label distribution of each device) against each device's true
    counts (devices x classes): accuracy, naming each device's most frequent class by its top
    score; AUC, over every (device, class), of the scores separating the classes a device holds
    more of than an even share from the rest; chance, the most common true top class's share."""
    counts = true_counts.double()
    top = counts.argmax(dim=1)
    accuracy = float((scores.argmax(dim=1) == top).double().mean())
    over = counts > counts.sum(dim=1, keepdim=True) / counts.shape[1]
    auc = binary_auc(scores.flatten(), over.flatten())
    return LabelAttack(accuracy, auc, float(torch.bincount(top).max()) / len(top), len(top))


def head_update_scores(global_bias: torch.Tensor, uploaded_bias: torch.Tensor) -> torch.Tensor:
    """The head-update attack's evidence on one device (the Fed Server's): under cross-entropy the
    head's bias moves by ``-lr * sum(p - onehot(y))`` over the device's steps, so it rises most for
    the classes the device holds most of. The change itself is the score (centred by
    :func:`distribution_scores`).

    Under secure aggregation the Fed Server stores a device's upload as masked fixed-point words
    (int64) of its change: the attack reads them as it would the change, as signed integers (the
    encoding's scale, common to every device, changes no ranking), and finds the masks' noise."""
    if not uploaded_bias.is_floating_point():
        return uploaded_bias.double()
    return uploaded_bias.double() - global_bias.double()


# --- input reconstruction ----------------------------------------------------------------------

class InverseNetwork(nn.Module):
    """Maps activations at one cut back to an input image: two fully connected layers, the
    activations flattened (the decoder any cut's shape fits)."""

    def __init__(self, features: int, image_shape: tuple[int, ...], hidden: int = 512) -> None:
        super().__init__()
        self.image_shape = image_shape
        pixels = 1
        for d in image_shape:
            pixels *= d
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, pixels))

    def forward(self, fx: torch.Tensor) -> torch.Tensor:
        return self.layers(fx).view(-1, *self.image_shape)


def train_inverse(front: nn.Module, auxiliary: torch.Tensor, epochs: int = 30, batch_size: int = 64,
                  seed: int = 0, noise_scale: float = 0.0) -> InverseNetwork:
    """An inverse network trained to map ``front``'s activations of the ``auxiliary`` images back to
    them (mean squared error, Adam). ``noise_scale``: the attacker knows the run's activation noise
    (a run's defences are public, ``GET /v1/run``) and trains on activations noised alike."""
    torch.manual_seed(seed)
    front.eval()
    with torch.no_grad():
        fx = torch.cat([front(part) for part in torch.split(auxiliary, 256)])
    inverse = InverseNetwork(fx[0].numel(), tuple(auxiliary.shape[1:]))
    optimiser = torch.optim.Adam(inverse.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(fx), generator=generator)
        for index in torch.split(order, batch_size):
            batch = fx[index]
            if noise_scale > 0:
                rms = batch.flatten(1).pow(2).mean(dim=1).sqrt().view(-1, *([1] * (batch.dim() - 1)))
                batch = batch + noise_scale * rms * torch.randn(batch.shape, generator=generator)
            loss = nn.functional.mse_loss(inverse(batch), auxiliary[index])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    inverse.eval()
    return inverse


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """The mean squared difference of neighbouring pixels (down and across), averaged over the
    batch: small for smooth images, the prior UnSplit puts on what it rebuilds."""
    down = (images[:, :, 1:, :] - images[:, :, :-1, :]).pow(2).mean(dim=(1, 2, 3))
    across = (images[:, :, :, 1:] - images[:, :, :, :-1]).pow(2).mean(dim=(1, 2, 3))
    return (down + across).mean()


@dataclass(frozen=True)
class UnSplitBudget:
    """How long UnSplit optimises: ``rounds`` alternations of ``input_steps`` on the images and
    ``model_steps`` on the clone (the paper's demonstration: 1,000 x (100 + 100) per image)."""

    rounds: int = 20
    input_steps: int = 50
    model_steps: int = 50
    tv_weight: float = 0.1    # the paper's lambda_TV
    l2_weight: float = 1.0    # the paper's lambda_l2, on the unit-range pixels
    lr: float = 1e-3          # Adam (AMSGrad) for both, as the paper


def unsplit(clone: nn.Module, fx: torch.Tensor, image_shape: tuple[int, ...], low: float, high: float,
            budget: UnSplitBudget = UnSplitBudget(), seed: int = 0) -> torch.Tensor:
    """UnSplit's model inversion (Erdoğan, Küpçü and Çiçek, arXiv 2108.09033): a Main Server that
    knows the front's architecture but neither its weights nor any data rebuilds the images of
    the activations ``fx`` it received. ``clone``: the front's architecture with weights of the
    attacker's own (random) initialisation. From grey images (0.5 in unit range) it alternates
    steps on the images, against ``||clone(x) - fx||^2`` plus a total-variation and an L2 prior,
    and steps on the clone's weights against the first term alone. The images, in unit range
    ``[0, 1]`` (the model sees them mapped to the data's ``[low, high]``).

    Deviations, for the benchmark's budget: the received images are rebuilt together (one clone,
    one batch of images) rather than one after another, and for ``budget``'s steps rather than
    the paper's 200,000 an image."""
    torch.manual_seed(seed)
    clone.train()
    target = fx.detach()
    unit = torch.full((len(target), *image_shape), 0.5, requires_grad=True)
    images_opt = torch.optim.Adam([unit], lr=budget.lr, amsgrad=True)
    clone_opt = torch.optim.Adam(clone.parameters(), lr=budget.lr, amsgrad=True)

    def mismatch() -> torch.Tensor:
        return nn.functional.mse_loss(clone(low + (high - low) * unit), target)

    for _ in range(budget.rounds):
        for _ in range(budget.input_steps):
            loss = mismatch() + budget.tv_weight * total_variation(unit) + budget.l2_weight * unit.pow(2).mean()
            images_opt.zero_grad()
            loss.backward()
            images_opt.step()
        for _ in range(budget.model_steps):
            loss = mismatch()
            clone_opt.zero_grad()
            loss.backward()
            clone_opt.step()
    return unit.detach().clamp(0.0, 1.0)
