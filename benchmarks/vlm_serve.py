"""Image + text serving latency through ``lmforge serve``: time to first token (TTFT) of a chat
request with one image, against a text-only request of the same prompt length on the same
server (the peer), and with the same image again (prefix-cache hit on its slots).

The VLM is a random-weight run folder in the layout ``lmforge vision vlm`` writes (ViT-B/16 at
224 px: 196 image tokens; a 12-layer, 768-wide LM on the procedural-scenes vocabulary),
served by the user's command, ``lmforge serve --checkpoint DIR`` (defaults: bf16, CUDA graphs,
compiled decode), as a subprocess on 127.0.0.1. A request is a non-streamed chat completion
with ``max_tokens=1`` timed by the client: its latency is the TTFT (HTTP, JSON, base64 + PNG
decode and CLIP preprocessing in the API process, the pixels over the pipe, the tower in the
engine process, prefill). Medians over ``--iters`` requests after 3 warm-up ones; a fresh
image per request unless said. The table also times the two image stages alone (decode +
preprocess on the host; the tower's forward on the device, CUDA events).

Correctness first: the served top-5 logprobs of the first token equal the VLM's own training
forward (``VisionLanguageModel.forward``, float32, full recompute) within 0.1 (the server runs
bf16 on CUDA; 1e-3 on the CPU, float32).

    PYTHONPATH=src python benchmarks/vlm_serve.py --out bench_out/vlm_serve
    PYTHONPATH=src python benchmarks/vlm_serve.py --quick     # CPU smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

QUESTION = "how many shapes are there ?"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--iters", type=int, default=20, help="timed requests per case")
    p.add_argument("--width", type=int, default=768, help="ViT and LM width")
    p.add_argument("--layers", type=int, default=12, help="ViT and LM layers")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--out", help="folder for results.json")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=180,
        help="seconds one request may take; past it the server's stacks (SIGUSR1) are printed",
    )
    p.add_argument("--quick", action="store_true", help="CPU smoke test: a tiny VLM, 3 requests")
    args = p.parse_args()
    args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.quick:
        args.iters, args.width, args.layers, args.image_size, args.patch = 3, 64, 1, 32, 8
    return args


def write_vlm_folder(args: argparse.Namespace, out: Path) -> None:
    """A VLM run folder as ``lmforge vision vlm`` lays it out, random weights."""
    import dataclasses

    from lmforge.checkpoint import checkpoint_path, save_checkpoint
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.utils.config import save_config
    from lmforge.vision.data import WordTokenizer
    from lmforge.vision.encoders import ViT, ViTConfig
    from lmforge.vision.scenes import vocabulary
    from lmforge.vision.vlm import VisionLanguageModel
    from lmforge.vision.vlm_train import VLMRunConfig

    words = WordTokenizer(vocabulary())
    heads = max(1, args.width // 64)
    vit_cfg = ViTConfig(args.image_size, args.patch, args.width, args.layers, heads)
    lm_cfg = ModelConfig(vocab_size=words.vocab_size, context_length=1024, d_model=args.width,
                         n_layers=args.layers, n_heads=heads)  # fmt: skip
    torch.manual_seed(0)
    vlm = VisionLanguageModel(ViT(vit_cfg), TransformerLM(lm_cfg), words.image_id)
    out.mkdir(parents=True)
    save_config(dataclasses.replace(VLMRunConfig(), lm=lm_cfg), out / "config.toml")
    save_config(vit_cfg, out / "vision.toml")
    words.save(out / "vocab.json")
    save_checkpoint(checkpoint_path(out / "stage2", 1), vlm, None, 1)


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _scenes(n: int, size: int) -> list[np.ndarray]:
    from lmforge.vision.scenes import ProceduralScenes

    scenes = ProceduralScenes(seed=11, split="val", image_size=size)
    return [np.asarray(scenes[i].image) for i in range(n)]


def _image_body(png: bytes, **kw: object) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0, **kw}  # fmt: skip


def _start_server(folder: Path, port: int, device: str, log: Path) -> subprocess.Popen:
    import httpx

    exe = shutil.which("lmforge")
    head = [exe] if exe else [sys.executable, "-m", "lmforge"]
    cmd = [*head, "serve", "--checkpoint", str(folder), "--port", str(port), "--device", device]
    src = str(_HERE.parent / "src")
    rest = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{src}:{rest}" if rest else src}
    # its own process group: SIGUSR1 to the group reaches the API and the engine process
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 420:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not answer /health within 420 s")


@torch.no_grad()
def check_logprobs(http, folder: Path, image: np.ndarray, device: str) -> float:
    """Largest |served - reference| logprob over the served top-5 of the first token."""
    from lmforge.serve.templates import render_template
    from lmforge.vision.data import preprocess
    from lmforge.vision.serving import load_vlm, prepare_image_prompt

    t0 = time.perf_counter()
    r = http.post("/chat/completions", json=_image_body(_png(image), logprobs=True, top_logprobs=5))
    r.raise_for_status()
    print(f"first image request answered in {time.perf_counter() - t0:.1f} s", flush=True)
    top = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    loaded = load_vlm(folder, device=device, dtype=torch.float32)
    text = render_template(loaded.template, [{"role": "user", "content": "<image>\n" + QUESTION}])
    ids = prepare_image_prompt(loaded.tower, loaded.tokenizer.encode(text), [image]).token_ids
    pixels = preprocess(image, loaded.tower.image_size)[None].to(device)  # (1, 3, S, S)
    logits = loaded.vlm(torch.tensor([ids], device=device), pixels)[0, -1]  # (V,)
    ref = torch.log_softmax(logits.double(), -1)
    stoi = loaded.tokenizer.words.stoi  # special tokens read as "": not compared
    err = max(abs(t["logprob"] - ref[stoi[t["token"]]].item()) for t in top if t["token"] in stoi)
    # bf16 serving (weights, activations, KV) against the float32 forward
    tol = 0.1 if device == "cuda" else 1e-3
    assert err < tol, f"served logprobs differ from the reference forward by {err:.3f}"
    return err


def _ttft(http, name: str, bodies: list[dict], iters: int) -> tuple[str, list[float]]:
    """Client-timed latency (ms) of each max_tokens=1 request after 3 warm-up ones. Says which
    case starts and every request over a second (where a slow or hung request is)."""
    print(f"case: {name}", flush=True)
    out = []
    for i, body in enumerate(bodies[: iters + 3]):
        t0 = time.perf_counter()
        r = http.post("/chat/completions", json=body)
        r.raise_for_status()
        ms = (time.perf_counter() - t0) * 1e3
        if ms > 1e3:
            print(f"  request {i + 1} took {ms / 1e3:.1f} s", flush=True)
        if i >= 3:
            out.append(ms)
    return name, out


def _process_states(pgid: int) -> str:
    """``ps`` lines (state, kernel wait channel, CPU time) of the server's process group: a
    process that printed no stack for SIGUSR1 may be in the kernel (state D) or gone."""
    r = subprocess.run(["ps", "-eo", "pid,pgid,stat,wchan:24,time,args"], capture_output=True,
                       text=True)  # fmt: skip
    lines = r.stdout.splitlines()
    mine = [ln for ln in lines[1:] if ln.split()[1] == str(pgid)]
    return "\n".join(lines[:1] + mine) or r.stderr


def image_stages(folder: Path, png: bytes, device: str, iters: int) -> tuple[float, float]:
    """(decode + preprocess ms on the host, tower forward ms on the device) of one image."""
    from lmforge.bench.timing import time_ms
    from lmforge.vision.serving import decode_data_url, decode_image, image_pixels, load_vlm

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tower = load_vlm(folder, device=device, dtype=dtype).tower
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    host = []
    for _ in range(iters + 3):
        t0 = time.perf_counter()
        px, _ = image_pixels(decode_image(decode_data_url(url)), tower.image_size)
        host.append((time.perf_counter() - t0) * 1e3)
    dev = time_ms(lambda: tower(px[None].to(device)), iters=iters, device=device)
    return statistics.median(host[3:]), dev


def main() -> None:
    import httpx

    from lmforge.vision.scenes import vocabulary

    args = _parse()
    tmp = Path(tempfile.mkdtemp(prefix="vlm_serve_"))
    folder = tmp / "vlm"
    write_vlm_folder(args, folder)
    n_slots = (args.image_size // args.patch) ** 2
    images = _scenes(2 * (args.iters + 3) + 1, args.image_size)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the server's own log beside the results (where a slow start-up or a failure shows)
    log = Path(args.out) / "server.log" if args.out else tmp / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting lmforge serve on 127.0.0.1:{port} (log {log})", flush=True)
    t0 = time.perf_counter()
    proc = _start_server(folder, port, args.device, log)
    print(f"server answered /health after {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        timeout = args.request_timeout
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=timeout) as http:
            err = check_logprobs(http, folder, images[-1], args.device)
            n = args.iters + 3
            fresh = [_image_body(_png(im)) for im in images[:n]]
            same = [_image_body(_png(images[n]))] * n
            # one token a word, as many as the image's slots; each prompt starts with another
            # word, so the text peer gets no prefix-cache hit either
            vocab = vocabulary()
            text = [{"messages": [{"role": "user", "content": " ".join(
                        [vocab[i % len(vocab)], *["red"] * (n_slots - 1), QUESTION])}],
                     "max_tokens": 1, "temperature": 0} for i in range(n)]  # fmt: skip
            rows = [
                _ttft(http, "text only, same prompt length (peer)", text, args.iters),
                _ttft(http, "one image, a new image each request", fresh, args.iters),
                _ttft(http, "one image, the same image again", same, args.iters),
            ]
    except httpx.TimeoutException:
        # where the server waits: every thread's stack of both processes, into its log (the
        # group's other members, e.g. inductor's compile workers, end on SIGUSR1: we stop anyway)
        states = _process_states(proc.pid)
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(3)
        print(f"a request took over {timeout:.0f} s; the server's processes:\n{states}\n"
              f"its log with their stacks:\n{log.read_text()[-12000:]}", flush=True)  # fmt: skip
        raise SystemExit(f"vlm_serve: a request took over {timeout:.0f} s (stacks above)") from None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    host_ms, tower_ms = image_stages(folder, _png(images[0]), args.device, args.iters)
    shutil.rmtree(tmp, ignore_errors=True)
    results = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "image_tokens": n_slots,
        "width": args.width,
        "layers": args.layers,
        "logprob_max_abs_err": err,
        "decode_preprocess_ms": host_ms,
        "tower_forward_ms": tower_ms,
        "ttft_ms": {
            name: {"median": statistics.median(v), "p90": float(np.percentile(v, 90))}
            for name, v in rows
        },
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nlmforge serve --checkpoint VLM (random weights, ViT + LM {args.layers}x{args.width}, "
          f"{n_slots} image tokens) on {results['device']}; correctness: served top-5 logprobs "
          f"within {err:.4f} of the VLM's own forward")  # fmt: skip
    print(f"{'case':<42} {'TTFT median ms':>15} {'p90 ms':>9}")
    for name, v in rows:
        print(f"{name:<42} {statistics.median(v):>15.2f} {np.percentile(v, 90):>9.2f}")
    print(f"{'  image decode + preprocess (host)':<42} {host_ms:>15.2f}")
    print(f"{'  vision tower forward (device)':<42} {tower_ms:>15.2f}")


if __name__ == "__main__":
    main()
