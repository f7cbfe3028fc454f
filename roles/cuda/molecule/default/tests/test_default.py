"""cuda against the fake NVIDIA mirror: the pinned 12.x toolkit, on PATH and on the loader path."""


def test_pinned_toolkit_installed(host):
    pkg = host.package("cuda-toolkit-12-4")
    assert pkg.is_installed
    assert pkg.version == "12.4.1-1"
    assert not host.package("cuda-toolkit-12-6").is_installed


def test_nvcc_on_login_shell_path(host):
    profile = host.file("/etc/profile.d/sarv-cuda.sh")
    assert profile.mode == 0o644
    assert "Ansible managed" in profile.content_string
    out = host.check_output("bash -lc 'command -v nvcc && nvcc --version'")
    assert "/usr/local/cuda-12.4/bin/nvcc" in out
    assert "release 12.4" in out
    assert host.check_output("bash -lc 'echo $CUDA_HOME'") == "/usr/local/cuda-12.4"


def test_loader_path(host):
    conf = host.file("/etc/ld.so.conf.d/sarv-cuda.conf")
    assert conf.mode == 0o644
    assert "/usr/local/cuda-12.4/lib64" in conf.content_string.splitlines()
