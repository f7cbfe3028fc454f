"""dcgm_exporter against the fake NVIDIA mirror: pinned DCGM, exporter unit pinned by digest and confined."""

UNIT = "/etc/systemd/system/dcgm-exporter.service"
IMAGE = (
    "registry.example.internal/nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04"
    "@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
)


def test_pinned_dcgm(host):
    pkg = host.package("datacenter-gpu-manager")
    assert pkg.is_installed
    assert pkg.version == "1:3.3.9"  # 1:3.3.10 is in the mirror too


def test_units_enabled(host):
    assert host.service("nvidia-dcgm").is_enabled
    assert host.service("dcgm-exporter").is_enabled


def test_exporter_unit(host):
    unit = host.file(UNIT)
    assert unit.user == "root"
    assert unit.mode == 0o644
    text = unit.content_string
    assert "Ansible managed" in text
    assert IMAGE in text
    assert "--address 10.20.0.11:9400" in text
    assert "--security-opt no-new-privileges" in text
    assert "--read-only" in text
    assert "--privileged" not in text
    assert "SYS_ADMIN" not in text  # profiling metrics are off by default
    assert "Requires=docker.service" in text
