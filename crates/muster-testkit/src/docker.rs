//! A container image for tests, made on this machine (there is no registry
//! to pull from): `muster-test-busybox:1`, imported into the local Docker
//! engine from a root file system holding Debian's statically linked
//! busybox (`busybox-static`) and links to a few of its tools.
//!
//! [`test_image`] answers `None` (and says so loudly) where there is no
//! Docker engine or no busybox, unless `MUSTER_REQUIRE_DOCKER` is set
//! (`.ci/run` sets it once it has an engine running), where that is a
//! failure.

use std::path::Path;
use std::process::Command;

pub const TEST_IMAGE: &str = "muster-test-busybox:2";

const TOOLS: [&str; 15] = [
    "sh", "echo", "env", "sleep", "cat", "id", "head", "tr", "sort", "pwd", "ls", "hostname", "nc",
    "seq", "timeout",
];

fn image_present() -> bool {
    Command::new("docker")
        .args(["image", "inspect", TEST_IMAGE])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// The test image's name, once it is in the local engine.
pub fn test_image() -> Option<&'static str> {
    let required = std::env::var_os("MUSTER_REQUIRE_DOCKER").is_some();
    let engine = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output()
        .is_ok_and(|output| output.status.success());
    let busybox = Path::new("/bin/busybox");
    if !engine || !busybox.exists() {
        assert!(
            !required,
            "the container tests need a Docker engine and /bin/busybox (Debian's busybox-static)"
        );
        eprintln!(
            "\n*** NO DOCKER ENGINE OR BUSYBOX: the container tests did not run (install \
             docker.io and busybox-static) ***\n"
        );
        return None;
    }
    // One import at a time on this machine (test processes run side by
    // side; a second import of the tag would replace the first's image).
    let lock = std::fs::File::create(std::env::temp_dir().join("muster-test-image.lock"))
        .expect("the lock file");
    lock.lock().expect("the image lock");
    if image_present() {
        return Some(TEST_IMAGE);
    }
    let root = tempfile::tempdir().expect("a directory");
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::create_dir_all(root.path().join("tmp")).expect("tmp");
    std::fs::copy(busybox, bin.join("busybox")).expect("busybox");
    for tool in TOOLS {
        std::os::unix::fs::symlink("busybox", bin.join(tool)).expect("symlink");
    }
    let tar = root.path().join("root.tar");
    let made = Command::new("tar")
        .arg("-C")
        .arg(root.path())
        .arg("-cf")
        .arg(&tar)
        .args(["bin", "tmp"])
        .status()
        .expect("tar runs");
    assert!(made.success(), "tar failed");
    let imported = Command::new("docker")
        .arg("import")
        .arg(&tar)
        .arg(TEST_IMAGE)
        .output()
        .expect("docker import runs");
    assert!(
        imported.status.success(),
        "docker import: {}",
        String::from_utf8_lossy(&imported.stderr)
    );
    Some(TEST_IMAGE)
}
