"""FCSD's loss: forward KL(teacher || student) per token at temperature 1, in fp32, over the
whole vocabulary, computed in token chunks so that [tokens, vocab] logits never exist at once
(Moonlight: 163,840 x 4 B = 655 KB per token in fp32).

For one token with student log-probs log p and teacher probs q:

    KL(q || p) = sum_v q_v (log q_v - log p_v),   d KL / d logits_student = p - q
    CE         = -log p_label,                    d CE / d logits_student = p - onehot(label)

The gradient with respect to the student's hidden states and lm_head weight is formed chunk by
chunk during the forward (the logits are linear in both), so backward has nothing to recompute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a position without a next token (CE only; KL covers every position)


def _chunks(n: int, chunk: int):
    return ((i, min(i + chunk, n)) for i in range(0, n, chunk))


class _ChunkedDistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_hidden, s_weight, t_hidden, t_weight, labels, ce_weight: float, chunk: int):
        """s_hidden, t_hidden [N, H]; s_weight, t_weight [V, H]; labels [N]. Returns the summed
        (1 - ce_weight) * KL + ce_weight * CE, and the KL and CE sums alone."""
        grad_hidden = torch.zeros_like(s_hidden)
        grad_weight = torch.zeros_like(s_weight, dtype=torch.float32)
        kl_sum = s_hidden.new_zeros((), dtype=torch.float32)
        ce_sum = kl_sum.clone()
        w32 = s_weight.float()  # one fp32 copy, not one per chunk
        for lo, hi in _chunks(s_hidden.shape[0], chunk):
            h = s_hidden[lo:hi]
            s_logp = F.linear(h, s_weight).float().log_softmax(-1)  # [n, V]
            t_logp = F.linear(t_hidden[lo:hi], t_weight).float().log_softmax(-1)
            q = t_logp.exp()
            kl_sum += (q * (t_logp - s_logp)).sum()
            grad = s_logp.exp() - q  # d KL / d logits
            if ce_weight:
                lab = labels[lo:hi]
                valid = lab != IGNORE
                safe = lab.clamp(min=0)[:, None]
                ce_sum -= (s_logp.gather(1, safe)[:, 0] * valid).sum()
                ce_grad = (s_logp.exp() * valid[:, None]).scatter_add_(1, safe, -valid[:, None].float())
                grad = (1 - ce_weight) * grad + ce_weight * ce_grad
            grad_hidden[lo:hi] = (grad @ w32).to(s_hidden.dtype)
            grad_weight += grad.T @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(s_weight.dtype))
        ctx.mark_non_differentiable(kl_sum, ce_sum)
        return (1 - ce_weight) * kl_sum + ce_weight * ce_sum, kl_sum, ce_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None, None


def distill_loss(s_hidden, s_weight, t_hidden, t_weight, labels=None, *, ce_weight: float = 0.0, chunk: int = 1024):
    """Summed loss, KL and CE over N tokens (divide by N for the per-token mean). The teacher side
    gets no gradient. `labels` [N] is needed only when ce_weight > 0."""
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight={ce_weight}: must be in [0, 1]")
    if labels is None:
        if ce_weight:
            raise ValueError("ce_weight > 0 needs labels")
        labels = torch.full(s_hidden.shape[:1], IGNORE, dtype=torch.long, device=s_hidden.device)
    return _ChunkedDistillLoss.apply(s_hidden, s_weight, t_hidden.detach(), t_weight.detach(), labels, ce_weight, chunk)


@torch.no_grad()
def eval_sums(s_hidden, s_weight, t_hidden, t_weight, labels, *, chunk: int = 1024) -> dict[str, float]:
    """Held-out sums over N tokens: KL(t||s), top-1 agreement (argmax equal), the CE of student and
    teacher on `labels` (for perplexity), and the token counts."""
    out = dict.fromkeys(["kl", "agree", "tokens", "ce_student", "ce_teacher", "ce_tokens"], 0.0)
    for lo, hi in _chunks(s_hidden.shape[0], chunk):
        s_logp = F.linear(s_hidden[lo:hi], s_weight).float().log_softmax(-1)
        t_logp = F.linear(t_hidden[lo:hi], t_weight).float().log_softmax(-1)
        out["kl"] += float((t_logp.exp() * (t_logp - s_logp)).sum())
        out["agree"] += float((s_logp.argmax(-1) == t_logp.argmax(-1)).sum())
        out["tokens"] += hi - lo
        lab = labels[lo:hi]
        valid = lab != IGNORE
        safe = lab.clamp(min=0)[:, None]
        out["ce_student"] -= float((s_logp.gather(1, safe)[:, 0] * valid).sum())
        out["ce_teacher"] -= float((t_logp.gather(1, safe)[:, 0] * valid).sum())
        out["ce_tokens"] += float(valid.sum())
    return out
