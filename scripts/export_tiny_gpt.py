# Regenerates tests/data/onnx/tiny_gpt*: python3 scripts/export_tiny_gpt.py tests/data/onnx (PyTorch).
# Exports a small GPT-style transformer (2 pre-norm blocks: causal self-attention, erf GELU MLP)
# to ONNX with symbolic batch and sequence dims, plus one input and PyTorch's output.
import sys, numpy as np, torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
D, H, L, V = 64, 4, 2, 97


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.reshape(b, s, H, D // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (D // H) ** 0.5
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(64, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, ids):
        s = ids.shape[1]
        x = self.emb(ids) + self.pos(torch.arange(s, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


m = Tiny().eval()
ids = torch.randint(0, V, (3, 17))
with torch.no_grad():
    logits = m(ids)
out = sys.argv[1]
torch.onnx.export(m, (ids,), f"{out}/tiny_gpt.onnx", input_names=["ids"], output_names=["logits"],
                  dynamic_axes={"ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}},
                  opset_version=17, dynamo=False)
np.save(f"{out}/tiny_gpt_ids.npy", ids.numpy())
np.save(f"{out}/tiny_gpt_logits.npy", logits.numpy())
print("exported", torch.__version__)
