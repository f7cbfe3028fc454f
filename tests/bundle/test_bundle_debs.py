"""Which `.deb` packages a bundle carries for a package list: what apt installs on a fresh system."""

from __future__ import annotations

from fixtures.common import need_binary

from controlplane.bundle.create import _deb_closure


def test_the_closure_takes_the_alternative_apt_installs_not_every_one() -> None:
    need_binary("apt-get")
    names = set(_deb_closure(["gnupg"]))
    # gpg-agent depends on `pinentry-curses | pinentry`: apt takes pinentry-curses, and nothing that
    # provides `pinentry` besides (GTK, Qt, GNOME and FLTK front ends and all they depend on).
    assert {"gnupg", "gpg", "gpg-agent", "dirmngr", "pinentry-curses"} <= names
    assert not names & {"pinentry-gtk2", "pinentry-qt", "pinentry-gnome3", "pinentry-fltk", "libgtk2.0-0"}
    # The base system every host has (Essential, Priority: required) stays out.
    assert not names & {"dpkg", "coreutils", "tar", "passwd"}
    assert len(names) < 100, sorted(names)  # 65 on Debian 12 (288 with every alternative followed)
