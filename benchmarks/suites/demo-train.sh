#!/usr/bin/env bash
# trains the demo target and its EAGLE-1 head for the speculative-decoding demo (not a measurement)
# The ~16.5M-parameter demo target (the bundled 4,096-token tokenizer, so the small demo model drafts for it) on
# the stdlib plus the image's permissively licensed packages, then its EAGLE-1 head.
# They come back as demo_target.tar.part-* and eagle.tar
# (at most 15 MB a file: the device tool returns files up to 16 MiB). Here: cat the parts | tar x.
#   TARGET_MIN=5.5 EAGLE_MIN=1.5 [EXTRA_MB=200] [DROPOUT=0.1] bash benchmarks/gpu.sh demo-train
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh "$@"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# Installed packages whose code is training data (each is license-checked by the script); the ones present.
extra=$($py -c "
import importlib.util as u, sys
from importlib.metadata import packages_distributions
sys.path.insert(0, 'tools')
from train_demo_model import is_permissive, package_license
dists = packages_distributions()
names = 'torch transformers numpy scipy sympy networkx jax flax optax pandas sklearn accelerate huggingface_hub safetensors tokenizers torchvision torchaudio lightning pytorch_lightning lightning_fabric torchmetrics botorch gpytorch numpyro onnx onnxscript jinja2 triton cupy sentence_transformers'.split()
keep = []
for n in names:
    s = u.find_spec(n)
    if s is None or not s.submodule_search_locations:
        continue
    lic = package_license((dists.get(n) or [n])[0])
    (keep.append(n) if is_permissive(lic) else print(f'skipped {n}: {lic!r}', file=sys.stderr))
print(' '.join('--extra-corpus ' + n for n in keep))")
echo "extra corpus: $extra"
T="$out/demo_target"
$py tools/train_demo_model.py --config target --tokenizer pagedllm/demo_model --include-tests $extra --dropout "${DROPOUT:-0.1}" \
  --max-extra-mb "${EXTRA_MB:-200}" --max-minutes "${TARGET_MIN:-5.5}" --out "$T" 2>&1 \
  | grep -vE "Loading weights|^\s*$" | tail -60
# The target comes back first, so a call cut short in the head's training still returns it.
tar -C "$out" -cf - demo_target | split -b 15000000 - "$out/demo_target.tar.part-"
$py tools/train_eagle_head.py --target "$T" --out "$out/eagle" --include-tests $extra \
  --max-extra-mb "${EXTRA_MB:-200}" --max-minutes "${EAGLE_MIN:-1.5}" 2>&1 | grep -vE "Loading weights" | tail -25
tar -C "$out" -cf "$out/eagle.tar" eagle && rm -rf "$out/eagle"
rm -rf "$T"
ls -la "$out"
