import json, sys, torch
sys.path.insert(0, '.')
from onespec.layers.triton_linear import small_linear
torch.manual_seed(0)
w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
xs = [torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
def t(cfg, reps=20):
    f = lambda: small_linear(xs[0], w, argmax=True, config=cfg)
    ref = small_linear(xs[0], w, argmax=True)
    got = f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(8): f()
    g.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(reps): g.replay()
        b.record(); b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps / 8)
    return best, bool((got == ref).all())
for cfg in [None, (32,256,4,5), (64,128,4,3), (64,128,4,4), (64,128,4,5), (64,256,4,3), (32,256,4,3), (32,256,4,4),
            (64,128,8,4), (128,128,8,3), (32,512,4,3), (16,512,4,4), (128,64,4,4), (64,64,4,6)]:
    try:
        us, same = t(cfg)
        print(json.dumps({"cfg": cfg, "us": round(us, 1), "gbps": round(w.numel()*2/us/1e3, 1), "same_token": same}), flush=True)
    except Exception as e:
        print(json.dumps({"cfg": cfg, "error": str(e)[:150]}), flush=True)
