//! Bearer tokens: the admin token (users and admins), the join token (agents
//! registering), and one token per node (its heartbeats and logs).
//!
//! The admin and join tokens are created on the first start, in
//! `data_dir/admin.token` and `data_dir/join.token`, readable by the owner
//! only; node tokens are issued at registration and kept in the store.

use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read or write the token file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("the token file {path} is empty; delete it to have a new token made")]
    Empty { path: PathBuf },
    #[error("the operating system gave no random bytes for a token: {0}")]
    Random(String),
}

/// A new random token: 32 bytes from the operating system, as hex.
pub fn new_token() -> Result<String, TokenError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|error| TokenError::Random(error.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Reads the token in `path`, or creates it (mode 0600) when the file does
/// not exist. Returns the token and whether it was created.
pub fn load_or_create(path: &Path) -> Result<(String, bool), TokenError> {
    let file_error = |error: std::io::Error| TokenError::File {
        path: path.to_path_buf(),
        reason: error.to_string(),
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let token = text.trim().to_string();
            if token.is_empty() {
                return Err(TokenError::Empty {
                    path: path.to_path_buf(),
                });
            }
            Ok((token, false))
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            // Written whole under a name of its own, then linked into place:
            // whoever reads the file (another server copying the cluster's
            // identity, a test) never finds it empty or half written, and a
            // file made meanwhile by another process is kept.
            let token = new_token()?;
            let mut name = path.as_os_str().to_os_string();
            static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            name.push(format!(".{}-{made}.new", std::process::id()));
            let temporary = PathBuf::from(name);
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(0o600);
            }
            let written = options.open(&temporary).and_then(|mut file| {
                file.write_all(format!("{token}\n").as_bytes())?;
                file.sync_all()
            });
            let linked = written.and_then(|()| std::fs::hard_link(&temporary, path));
            let _ = std::fs::remove_file(&temporary);
            match linked {
                Ok(()) => Ok((token, true)),
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                    load_or_create(path)
                }
                Err(error) => Err(file_error(error)),
            }
        }
        Err(error) => Err(file_error(error)),
    }
}

/// Compares two tokens in time independent of where they differ.
pub fn same_token(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bearer token of a request, if it has one.
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|token| !token.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_long_and_different() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(same_token(&a, &a.clone()));
        assert!(!same_token(&a, &b));
        assert!(!same_token(&a, "short"));
    }

    #[test]
    fn a_token_file_is_created_once_for_the_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.token");
        let (first, created) = load_or_create(&path).unwrap();
        assert!(created);
        let (again, created) = load_or_create(&path).unwrap();
        assert!(!created);
        assert_eq!(first, again);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    /// Readers racing the first writer (a second server copying the
    /// cluster's files, another process) see the whole token or nothing,
    /// and every one of them gets the same token.
    #[test]
    fn a_token_file_is_never_seen_half_written() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..20 {
            let path = dir.path().join(format!("token-{round}"));
            let tokens: Vec<String> = std::thread::scope(|scope| {
                let readers: Vec<_> = (0..6)
                    .map(|_| {
                        scope.spawn(|| match std::fs::read_to_string(&path) {
                            Ok(text) => assert_eq!(text.trim().len(), 64, "{text:?}"),
                            Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::NotFound),
                        })
                    })
                    .collect();
                let makers: Vec<_> = (0..4)
                    .map(|_| scope.spawn(|| load_or_create(&path).unwrap().0))
                    .collect();
                for reader in readers {
                    reader.join().unwrap();
                }
                makers.into_iter().map(|m| m.join().unwrap()).collect()
            });
            assert!(tokens.windows(2).all(|w| w[0] == w[1]), "{tokens:?}");
        }
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|name| name.to_string_lossy().ends_with(".new"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }
}
