import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """weight * x / rms(x), computed in float32 and cast back before the weight (as HF does)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)
