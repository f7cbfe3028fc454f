"""The model cache on a real (loop) block device: XFS, mounted by UUID with noatime, read-ahead set."""

DEVICE = "/dev/sarv-nvme0"
MOUNT = "/srv/models"


def test_xfs_with_the_sarv_label(host):
    assert host.check_output(f"blkid -p -o value -s TYPE {DEVICE}") == "xfs"
    assert host.check_output(f"blkid -p -o value -s LABEL {DEVICE}") == "sarv-models"


def test_mounted_with_noatime(host):
    mount = host.mount_point(MOUNT)
    assert mount.exists
    assert mount.filesystem == "xfs"
    assert "noatime" in mount.options


def test_fstab_by_uuid(host):
    uuid = host.check_output(f"blkid -s UUID -o value {DEVICE}")
    assert uuid
    lines = [line.split() for line in host.file("/etc/fstab").content_string.splitlines() if MOUNT in line]
    assert lines == [[f"UUID={uuid}", MOUNT, "xfs", "noatime,nofail", "0", "0"]]


def test_mount_point_owner_and_mode(host):
    d = host.file(MOUNT)
    assert d.is_directory
    assert d.user == "nobody"
    assert d.mode == 0o750


def test_read_ahead_now_and_at_boot(host):
    assert host.check_output(f"blockdev --getra {DEVICE}") == "16384"  # 8192 KiB in 512-byte sectors
    rule = host.file("/etc/udev/rules.d/69-sarv-model-cache.rules")
    assert rule.mode == 0o644
    assert 'ENV{ID_FS_LABEL}=="sarv-models"' in rule.content_string
    assert 'ATTR{queue/read_ahead_kb}="8192"' in rule.content_string


def test_no_array_for_a_single_device(host):
    assert not host.package("mdadm").is_installed
    assert host.package("xfsprogs").is_installed
