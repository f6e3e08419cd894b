//! HTTPS for the API.
//!
//! By default a server makes a cluster CA (ten years) and a server
//! certificate signed by it (one year, for the names it is reached by) in
//! `DATA_DIR/tls` at first start, with rcgen; clients pin the CA by its
//! SHA-256 fingerprint (`ca.sha256`), so the server certificate can be
//! renewed (30 days before it ends) or replaced on disk without touching
//! agents. With `--tls-cert/--tls-key` the operator's own files are served.
//! Either way the files are looked at every few seconds and a changed
//! certificate is served to new connections without a restart; a broken one
//! is reported and the previous one kept.
//!
//! TLS handshakes run in their own tasks, off the accept loop, bounded in
//! number and time, so a slow or silent client holds up no one else.

use anyhow::{Context, anyhow};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_rustls::server::TlsStream;

/// How the API is served.
#[derive(Debug, Clone, Default)]
pub enum TlsMode {
    /// Plain HTTP (`--insecure-http`, and the in-process tests).
    #[default]
    Off,
    /// The cluster CA and a certificate for these names (host names and IP
    /// addresses), made and renewed in `DATA_DIR/tls`.
    Generated { names: Vec<String> },
    /// The operator's certificate chain and key (PEM).
    Files { cert: PathBuf, key: PathBuf },
}

/// A server certificate is renewed this long before it ends.
const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long a generated server certificate is valid.
const SERVER_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How often the certificate files are looked at.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);
/// Connections in a handshake or waiting for axum to take them, at once,
/// and how long a handshake may take.
const MAX_HANDSHAKES: usize = 1024;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The CA's subject; the same every time, so the CA can sign again after a
/// restart from its key alone.
pub fn ca_params() -> rcgen::CertificateParams {
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "muster cluster CA");
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "muster");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    params
}

fn offset(time: SystemTime) -> time::OffsetDateTime {
    let seconds = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    time::OffsetDateTime::from_unix_timestamp(seconds).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes a file readable by its owner only (keys), through a rename.
fn write_file(path: &Path, contents: &str, private: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let temporary = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if private { 0o600 } else { 0o644 });
    }
    let mut file = options
        .open(&temporary)
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    file.write_all(contents.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The generated CA and server certificate in `DATA_DIR/tls`.
#[derive(Debug, Clone)]
pub struct Generated {
    pub dir: PathBuf,
}

impl Generated {
    pub fn ca_pem(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
    fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }
    pub fn cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }
    pub fn key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
    /// When the server certificate ends and the names it is for, so it is
    /// renewed in time and when the names change.
    fn meta(&self) -> PathBuf {
        self.dir.join("server.meta")
    }

    /// Makes the CA unless it exists, and a server certificate unless one
    /// for these names exists and has over 30 days left. Returns the CA's
    /// PEM.
    pub fn prepare(&self, names: &[String], now: SystemTime) -> anyhow::Result<String> {
        crate::create_private_dir(&self.dir)
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        let (ca_pem, ca_key) = if self.ca_pem().exists() && self.ca_key().exists() {
            let pem = std::fs::read_to_string(self.ca_pem())
                .with_context(|| format!("cannot read {}", self.ca_pem().display()))?;
            let key = std::fs::read_to_string(self.ca_key())
                .with_context(|| format!("cannot read {}", self.ca_key().display()))?;
            let key = rcgen::KeyPair::from_pem(&key).map_err(|error| {
                anyhow!("{} is not a usable key: {error}", self.ca_key().display())
            })?;
            (pem, key)
        } else {
            let key = rcgen::KeyPair::generate()
                .map_err(|error| anyhow!("cannot make the CA's key: {error}"))?;
            let mut params = ca_params();
            params.not_before = offset(now - Duration::from_secs(3600));
            params.not_after = offset(now + CA_VALIDITY);
            let certificate = params
                .self_signed(&key)
                .map_err(|error| anyhow!("cannot make the cluster CA: {error}"))?;
            write_file(&self.ca_key(), &key.serialize_pem(), true)?;
            write_file(&self.ca_pem(), &certificate.pem(), false)?;
            (certificate.pem(), key)
        };
        let fingerprint = muster_api::tls::fingerprint_of_pem(ca_pem.as_bytes())
            .map_err(|error| anyhow!("{}: {error}", self.ca_pem().display()))?;
        write_file(
            &self.dir.join("ca.sha256"),
            &format!("{fingerprint}\n"),
            false,
        )?;
        if !self.current(names, now) {
            self.issue(names, &ca_pem, &ca_key, now)?;
        }
        Ok(ca_pem)
    }

    /// Whether the server certificate on disk is for `names` and has over
    /// 30 days left.
    fn current(&self, names: &[String], now: SystemTime) -> bool {
        let Ok(meta) = std::fs::read_to_string(self.meta()) else {
            return false;
        };
        let mut not_after = 0u64;
        let mut issued_for: Vec<String> = Vec::new();
        for line in meta.lines() {
            if let Some(value) = line.strip_prefix("not_after=") {
                not_after = value.trim().parse().unwrap_or(0);
            } else if let Some(value) = line.strip_prefix("names=") {
                issued_for = value.split(',').map(str::to_string).collect();
            }
        }
        let mut wanted = names.to_vec();
        wanted.sort();
        issued_for.sort();
        self.cert().exists()
            && self.key().exists()
            && wanted == issued_for
            && not_after > unix_seconds(now + RENEW_BEFORE)
    }

    fn issue(
        &self,
        names: &[String],
        ca_pem: &str,
        ca_key: &rcgen::KeyPair,
        now: SystemTime,
    ) -> anyhow::Result<()> {
        let issuer = rcgen::Issuer::new(ca_params(), ca_key);
        let mut params = rcgen::CertificateParams::new(names.to_vec())
            .map_err(|error| anyhow!("cannot make a certificate for {names:?}: {error}"))?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "muster server");
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        params.not_before = offset(now - Duration::from_secs(3600));
        let not_after = now + SERVER_VALIDITY;
        params.not_after = offset(not_after);
        let mut serial = [0u8; 16];
        getrandom::fill(&mut serial).map_err(|error| anyhow!("no randomness: {error}"))?;
        serial[0] &= 0x7f;
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        let key = rcgen::KeyPair::generate()
            .map_err(|error| anyhow!("cannot make the server's key: {error}"))?;
        let certificate = params
            .signed_by(&key, &issuer)
            .map_err(|error| anyhow!("cannot sign the server certificate: {error}"))?;
        write_file(&self.key(), &key.serialize_pem(), true)?;
        write_file(
            &self.cert(),
            &format!("{}{}", certificate.pem(), ca_pem),
            false,
        )?;
        write_file(
            &self.meta(),
            &format!(
                "not_after={}\nnames={}\n",
                unix_seconds(not_after),
                names.join(",")
            ),
            false,
        )?;
        tracing::info!(names = %names.join(","), "issued a server certificate");
        Ok(())
    }
}

/// A certificate chain and key from PEM files.
pub fn load_certified_key(cert: &Path, key: &Path) -> anyhow::Result<CertifiedKey> {
    let text = std::fs::read(cert).with_context(|| format!("cannot read {}", cert.display()))?;
    let chain = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| anyhow!("{} is not a PEM certificate chain: {error}", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!(
            "{} holds no certificate (expected -----BEGIN CERTIFICATE-----)",
            cert.display()
        );
    }
    let key_text = std::fs::read(key).with_context(|| format!("cannot read {}", key.display()))?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_text)
        .map_err(|error| anyhow!("{} is not a PEM private key: {error}", key.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|error| anyhow!("{} is not a usable key: {error}", key.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|error| {
        anyhow!(
            "{} is not the key of {}: {error}",
            key.display(),
            cert.display()
        )
    })?;
    Ok(certified)
}

/// The certificate served now; swapped when the files change.
#[derive(Debug)]
pub struct Resolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
    }
}

/// The state of a TLS-serving server.
#[derive(Debug)]
pub struct Tls {
    pub resolver: Arc<Resolver>,
    cert: PathBuf,
    key: PathBuf,
    /// Set for the generated certificate: renewed in time.
    generated: Option<(Generated, Vec<String>)>,
    /// The cluster CA (generated mode).
    pub ca_pem: Option<String>,
}

/// What the certificate files looked like when last read.
type Stamp = Option<(SystemTime, u64, SystemTime, u64)>;

fn stamp(cert: &Path, key: &Path) -> Stamp {
    let a = std::fs::metadata(cert).ok()?;
    let b = std::fs::metadata(key).ok()?;
    Some((a.modified().ok()?, a.len(), b.modified().ok()?, b.len()))
}

impl Tls {
    /// Makes (generated mode) and reads the certificate; `None` when off.
    pub fn start(mode: &TlsMode, data_dir: &Path) -> anyhow::Result<Option<Tls>> {
        muster_api::tls::provider();
        let (cert, key, generated, ca_pem) = match mode {
            TlsMode::Off => return Ok(None),
            TlsMode::Generated { names } => {
                let generated = Generated {
                    dir: data_dir.join("tls"),
                };
                let ca = generated.prepare(names, SystemTime::now())?;
                (
                    generated.cert(),
                    generated.key(),
                    Some((generated, names.clone())),
                    Some(ca),
                )
            }
            TlsMode::Files { cert, key } => (cert.clone(), key.clone(), None, None),
        };
        let certified = load_certified_key(&cert, &key)?;
        Ok(Some(Tls {
            resolver: Arc::new(Resolver {
                current: RwLock::new(Arc::new(certified)),
            }),
            cert,
            key,
            generated,
            ca_pem,
        }))
    }

    /// The CA's fingerprint (generated mode).
    pub fn ca_sha256(&self) -> Option<muster_api::tls::Fingerprint> {
        self.ca_pem
            .as_deref()
            .and_then(|pem| muster_api::tls::fingerprint_of_pem(pem.as_bytes()).ok())
    }

    fn server_config(&self) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        let mut config = rustls::ServerConfig::builder_with_provider(muster_api::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|error| anyhow!("cannot set up TLS: {error}"))?
            .with_no_client_auth()
            .with_cert_resolver(self.resolver.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Renews the generated certificate when due, and serves the files anew
    /// when they changed. Runs until `stop`.
    pub async fn watch(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut seen = stamp(&self.cert, &self.key);
        let mut ticks = tokio::time::interval(RELOAD_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
            if let Some((generated, names)) = &self.generated
                && !generated.current(names, SystemTime::now())
            {
                let generated = generated.clone();
                let names = names.clone();
                let renewed = tokio::task::spawn_blocking(move || {
                    generated.prepare(&names, SystemTime::now())
                })
                .await;
                if let Ok(Err(error)) = renewed {
                    tracing::error!(error = %format!("{error:#}"), "cannot renew the server certificate");
                }
            }
            let now = stamp(&self.cert, &self.key);
            if now == seen {
                continue;
            }
            match load_certified_key(&self.cert, &self.key) {
                Ok(certified) => {
                    *self
                        .resolver
                        .current
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(certified);
                    seen = now;
                    tracing::info!(cert = %self.cert.display(), "serving a new TLS certificate");
                }
                // Half-written files are read again at the next look.
                Err(error) => {
                    tracing::warn!(error = %format!("{error:#}"), "the TLS certificate changed but cannot be used; still serving the previous one")
                }
            }
        }
    }

    /// Accepts TCP connections and hands on those whose handshake
    /// completes, until `stop`.
    pub fn listener(
        &self,
        tcp: TcpListener,
        mut stop: watch::Receiver<bool>,
    ) -> anyhow::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server_config()?);
        let (sender, receiver) = mpsc::channel(256);
        let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = tcp.accept() => accepted,
                    _ = stop.wait_for(|stop| *stop) => return,
                };
                let (stream, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(error) => {
                        // Out of file descriptors and the like: wait a
                        // little rather than spin.
                        tracing::warn!(%error, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    // Too many handshakes under way: this one is dropped.
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let acceptor = acceptor.clone();
                let sender = sender.clone();
                tokio::spawn(async move {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    match handshake {
                        // The permit is held until axum has the connection,
                        // so handshakes done but not yet taken are bounded
                        // too.
                        Ok(Ok(stream)) => {
                            let _ = sender.send((stream, peer)).await;
                            drop(permit);
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { receiver, local })
    }
}

/// Connections whose TLS handshake completed.
pub struct TlsListener {
    receiver: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.receiver.recv().await {
            Some(pair) => pair,
            // The acceptor stopped (shutdown): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
