"""Build the sandbox base image locally: debootstrap a Debian root filesystem, add an
unprivileged user, and ``docker import`` it, cached by a hash of the recipe.

No image registry is assumed. The recipe (suite, variant, packages, user, work dir) is
hashed; the hash is stored as the image label ``fleetrl.recipe``. ``ensure_image`` is a
no-op (one ``docker image inspect``) when an image of that name already carries the
same hash, so set-up scripts may call it on every run.

The mirror is not part of the recipe: any Debian mirror serves the same packages.
Building needs root (debootstrap), the ``debootstrap``, ``tar`` and ``docker``
executables, and network access to the mirror; using the image needs none of these.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import docker
import docker.errors
import msgspec

from .errors import ImageBuildError

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_PACKAGES",
    "ImageBuildError",
    "ImageRecipe",
    "BuildResult",
    "recipe_hash",
    "default_mirror",
    "ensure_image",
    "image_recipe_label",
]

DEFAULT_IMAGE = "fleetrl-sandbox:py311"
DEFAULT_PACKAGES: tuple[str, ...] = ("python3", "python3-pytest", "git", "ca-certificates")
RECIPE_LABEL = "fleetrl.recipe"
_RECIPE_FORMAT = 1  # bump when the build steps below change what ends up in the image
_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.\-]*$")  # Debian policy 5.6.1 package names
_SUITE_RE = re.compile(r"^[a-z][a-z0-9\-]*$")


class ImageRecipe(msgspec.Struct, frozen=True, kw_only=True):
    """What goes into the image. Everything here (and nothing else) is hashed."""

    suite: str = "bookworm"
    variant: str = "minbase"
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    user: str = "sandbox"
    uid: int = 1000
    workdir: str = "/work"

    def __post_init__(self) -> None:
        if not _SUITE_RE.match(self.suite):
            raise ValueError(f"ImageRecipe.suite: {self.suite!r} is not a Debian suite name")
        if self.variant not in ("minbase", "buildd", "fakechroot"):
            raise ValueError(f"ImageRecipe.variant: {self.variant!r} is not a debootstrap variant")
        for p in self.packages:
            if not _PKG_RE.match(p):
                raise ValueError(f"ImageRecipe.packages: {p!r} is not a valid Debian package name")
        if not re.match(r"^[a-z_][a-z0-9_\-]{0,31}$", self.user) or self.user == "root":
            raise ValueError(f"ImageRecipe.user: {self.user!r} must be a non-root user name")
        if not 1000 <= self.uid <= 60000:
            raise ValueError(f"ImageRecipe.uid: {self.uid} must be in [1000, 60000] (an unprivileged uid)")
        if not self.workdir.startswith("/") or self.workdir in ("/", "/tmp") or ".." in self.workdir:
            raise ValueError(f"ImageRecipe.workdir: {self.workdir!r} must be an absolute path other than / and /tmp")

    def with_extra_packages(self, extra: tuple[str, ...] | list[str]) -> "ImageRecipe":
        pkgs = tuple(sorted(set(self.packages) | {p.strip() for p in extra if p.strip()}))
        return msgspec.structs.replace(self, packages=pkgs)


class BuildResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    recipe_hash: str
    built: bool  # False: an image with this recipe already existed
    seconds: float


def recipe_hash(recipe: ImageRecipe) -> str:
    """sha256 (first 16 hex digits) of the canonical recipe; package order does not matter."""
    doc = msgspec.to_builtins(recipe)
    doc["packages"] = sorted(set(recipe.packages))
    doc["format"] = _RECIPE_FORMAT
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_mirror(sources: tuple[Path, ...] | None = None) -> str:
    """The first Debian (non-security) mirror apt on this machine uses, else deb.debian.org."""
    paths = sources
    if paths is None:
        d = Path("/etc/apt/sources.list.d")
        paths = (Path("/etc/apt/sources.list"), *(sorted(d.glob("*")) if d.is_dir() else ()))
    for p in paths:
        try:
            text = p.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text, re.M):
            uri = m.group(1).rstrip("/")
            if uri.startswith(("http://", "https://")) and uri.endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"


def image_recipe_label(client: docker.DockerClient, name: str) -> str | None:
    """The recipe label of local image ``name``, or None when there is no such image."""
    try:
        img = client.images.get(name)
    except docker.errors.ImageNotFound:
        return None
    return (img.labels or {}).get(RECIPE_LABEL)


def _run(step: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, check=True, capture_output=True, **kw)
    except FileNotFoundError as e:
        raise ImageBuildError(f"{step}: executable {argv[0]!r} not found") from e
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or b"")[-2000:].decode(errors="replace")
        raise ImageBuildError(f"{step}: {' '.join(argv[:3])} ... exited {e.returncode}: {tail}") from e


def _add_user(root: Path, recipe: ImageRecipe) -> None:
    """Add the unprivileged user and its work dir to the unpacked root filesystem."""
    u, uid = recipe.user, recipe.uid
    with open(root / "etc/passwd", "a") as f:
        f.write(f"{u}:x:{uid}:{uid}:{u}:/home/{u}:/bin/sh\n")
    with open(root / "etc/group", "a") as f:
        f.write(f"{u}:x:{uid}:\n")
    shadow = root / "etc/shadow"
    if shadow.exists():
        with open(shadow, "a") as f:
            f.write(f"{u}:!:19000:0:99999:7:::\n")
    for d in (f"home/{u}", recipe.workdir.lstrip("/")):
        p = root / d
        p.mkdir(parents=True, exist_ok=True)
        os.chown(p, uid, uid)
        p.chmod(0o755)


def _slim(root: Path) -> None:
    """Drop apt caches and docs: smaller image, faster import."""
    for d in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info"):
        p = root / d
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def ensure_image(
    name: str = DEFAULT_IMAGE,
    *,
    recipe: ImageRecipe | None = None,
    mirror: str | None = None,
    client: docker.DockerClient | None = None,
    force: bool = False,
    workroot: str | None = None,
    log=None,
) -> BuildResult:
    """Build image ``name`` from ``recipe`` unless it already exists with the same recipe hash.

    Blocking (minutes when it builds); call from a thread in async code.
    """
    recipe = recipe or ImageRecipe()
    h = recipe_hash(recipe)
    client = client or docker.from_env()
    t0 = time.monotonic()
    if not force and image_recipe_label(client, name) == h:
        return BuildResult(name=name, recipe_hash=h, built=False, seconds=time.monotonic() - t0)
    if os.geteuid() != 0:
        raise ImageBuildError("build-image: debootstrap needs root")
    mirror = mirror or default_mirror()
    say = log or (lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="fleetrl-rootfs-", dir=workroot) as tmp:
        root = Path(tmp) / "rootfs"
        say(f"debootstrap {recipe.suite} ({','.join(recipe.packages)}) from {mirror}")
        _run(
            "debootstrap",
            [
                "debootstrap",
                f"--variant={recipe.variant}",
                f"--include={','.join(sorted(set(recipe.packages)))}",
                recipe.suite,
                str(root),
                mirror,
            ],
        )
        _add_user(root, recipe)
        _slim(root)
        say(f"docker import -> {name}")
        changes = [
            f"USER {recipe.uid}:{recipe.uid}",
            f"WORKDIR {recipe.workdir}",
            "ENV PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8",
            f"ENV HOME=/home/{recipe.user}",
            f"LABEL {RECIPE_LABEL}={h}",
            'CMD ["/bin/sh"]',
        ]
        argv = ["docker", "import"]
        for c in changes:
            argv += ["--change", c]
        argv += ["-", name]
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            imp = subprocess.run(argv, stdin=tar.stdout, capture_output=True)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar_rc = tar.wait()
        if tar_rc != 0:
            raise ImageBuildError(f"tar of the root filesystem exited {tar_rc}")
        if imp.returncode != 0:
            raise ImageBuildError(f"docker import exited {imp.returncode}: {imp.stderr.decode(errors='replace')[-2000:]}")
    if image_recipe_label(client, name) != h:
        raise ImageBuildError(f"docker import: image {name!r} lacks label {RECIPE_LABEL}={h} after import")
    return BuildResult(name=name, recipe_hash=h, built=True, seconds=time.monotonic() - t0)
