#!/usr/bin/python
# Copyright: Sarv maintainers
# Apache-2.0
"""Rebuild the initramfs that boots next unless it is already newer than the files it must carry."""

DOCUMENTATION = r"""
module: sarv_initramfs
short_description: Rebuild the initramfs that boots next unless it is newer than the files it must carry
description:
  - Several roles write files that the initramfs must carry (nvme_raid's C(mdadm.conf), nvidia_driver's
    nouveau blacklist). Each calls this module after writing them. The image is rebuilt only when one of
    those files is newer than it, so a node whose roles change several such files in one run builds it
    once, and a run stopped between writing a file and rebuilding the image is finished by the next run.
  - The image is the one the node boots next, and the one its tool rebuilds. With C(update-initramfs)
    (Debian, Ubuntu), the newest installed kernel's C(/boot/initrd.img-VERSION), as C(linux-version) sorts
    them; with C(dracut) (RHEL and its rebuilds), the running kernel's C(/boot/initramfs-VERSION.img).
  - A missing image is created.
options:
  newer_than:
    description: Files the image must carry. Files that do not exist are left out.
    type: list
    elements: path
    required: true
notes:
  - Supports check mode (reports whether it would rebuild).
"""

EXAMPLES = r"""
- name: Update the initramfs unless it is newer than mdadm.conf
  sarv_initramfs:
    newer_than: [/etc/mdadm/mdadm.conf]
"""

RETURN = r"""
kernel:
  description: The kernel version whose image was checked.
  returned: always
  type: str
image:
  description: The image's path.
  returned: always
  type: str
newer:
  description: The files that were newer than the image (all of them when it did not exist).
  returned: always
  type: list
  elements: str
"""

import os

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC = {"newer_than": {"type": "list", "elements": "path", "required": True}}


def _newest_kernel(module):
    """The newest installed kernel's version, as Debian's linux-version sorts them."""
    tool = module.get_bin_path("linux-version", required=True)
    versions = module.run_command([tool, "list"], check_rc=True)[1].split()
    if not versions:
        module.fail_json(msg="no installed kernel found (linux-version list printed nothing): install one")
    ordered = module.run_command([tool, "sort", "--reverse"], data="\n".join(versions), check_rc=True)[1]
    return ordered.split()[0]


def next_boot(module, boot="/boot"):
    """(kernel version, image path, rebuild argv) for the initramfs that boots next."""
    update = module.get_bin_path("update-initramfs")
    if update:
        version = _newest_kernel(module)
        image = os.path.join(boot, f"initrd.img-{version}")
        return version, image, [update, "-u" if os.path.exists(image) else "-c", "-k", version]
    dracut = module.get_bin_path("dracut")
    if dracut:
        version = os.uname().release
        return version, os.path.join(boot, f"initramfs-{version}.img"), [dracut, "--force", "--kver", version]
    module.fail_json(
        msg="neither update-initramfs nor dracut is installed: install initramfs-tools or dracut"
    )
    raise AssertionError  # fail_json exits


def newer_than_image(image, paths):
    """The files in paths that are newer than image: all that exist when image does not."""
    existing = [p for p in paths if os.path.exists(p)]
    if not os.path.exists(image):
        return existing
    built = os.stat(image).st_mtime_ns
    return [p for p in existing if os.stat(p).st_mtime_ns >= built]


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        supports_check_mode=True,
    )
    version, image, rebuild = next_boot(module)
    newer = newer_than_image(image, module.params["newer_than"])
    result = {"changed": bool(newer), "kernel": version, "image": image, "newer": newer}
    if newer and not module.check_mode:
        rc, out, err = module.run_command(rebuild)
        if rc != 0:
            module.fail_json(
                msg=f"{' '.join(rebuild)} failed (exit {rc}): {(err or out).strip()[-2000:]}", **result
            )
        result["stdout"] = out
    module.exit_json(**result)


if __name__ == "__main__":
    main()
