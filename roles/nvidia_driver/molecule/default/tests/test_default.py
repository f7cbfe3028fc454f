"""nvidia_driver against the fake NVIDIA mirror: repository, pinned key, branch choice, nouveau blacklist."""

SOURCE = "/etc/apt/sources.list.d/nvidia-cuda.list"
KEYRING = "/etc/apt/keyrings/nvidia-cuda.asc"
MIRROR = "http://127.0.0.1:8089/cuda/debian12/x86_64"


def test_repository_entry_is_signed_by_the_pinned_keyring(host):
    f = host.file(SOURCE)
    assert f.mode == 0o644
    assert "Ansible managed" in f.content_string
    entries = [line for line in f.content_string.splitlines() if line.startswith("deb ")]
    assert entries == [f"deb [signed-by={KEYRING}] {MIRROR} /"]


def test_keyring_is_the_mirror_key(host):
    key = host.file(KEYRING)
    assert key.mode == 0o644
    fingerprints = [
        line.split(":")[9]
        for line in host.check_output(f"gpg --show-keys --with-colons {KEYRING}").splitlines()
        if line.startswith("fpr:")
    ]
    expected = host.check_output(
        "GNUPGHOME=/root/.fake-mirror-gnupg gpg --with-colons --list-keys | awk -F: '/^fpr/ {print $10; exit}'"
    )
    assert fingerprints[0] == expected


def test_pinned_branch_installed_from_the_mirror(host):
    pkg = host.package("cuda-drivers-550")
    assert pkg.is_installed
    assert pkg.version == "550.163.01-1"
    assert not host.package("cuda-drivers-570").is_installed
    policy = host.check_output("apt-cache policy cuda-drivers-550")
    assert MIRROR in policy


def test_apt_trusts_the_signed_mirror(host):
    # apt refuses unsigned or wrongly signed repositories: a clean update proves the signed-by chain.
    out = host.run("apt-get update -o Dir::Etc::sourcelist=" + SOURCE + " -o Dir::Etc::sourceparts=-")
    assert out.rc == 0, out.stderr
    assert "NO_PUBKEY" not in out.stderr
    assert "not signed" not in out.stderr


def test_nouveau_blacklisted(host):
    f = host.file("/etc/modprobe.d/blacklist-nouveau.conf")
    assert f.mode == 0o644
    assert "blacklist nouveau" in f.content_string.splitlines()
    assert "options nouveau modeset=0" in f.content_string.splitlines()
