//! How clients (the CLI, agents) trust the server's TLS certificate
//! (feature `client`).
//!
//! A muster server makes its own cluster CA at first start. A client trusts
//! it either from its PEM file (`ca_file`, which `muster up` writes into the
//! client config) or by its SHA-256 fingerprint alone, like
//! `kubeadm join --discovery-token-ca-cert-hash`: the server sends the CA in
//! its chain, the client looks for the certificate with the pinned
//! fingerprint there, and verifies the server's certificate (signature,
//! validity, name) against that CA and nothing else. With neither, the
//! system's roots are used (a publicly trusted certificate through
//! `--tls-cert`).

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::Digest;
use std::sync::Arc;

/// A certificate's SHA-256 fingerprint (of its DER bytes).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn of(der: &[u8]) -> Fingerprint {
        Fingerprint(sha2::Sha256::digest(der).into())
    }

    /// `sha256:` and 64 hex digits (colons between bytes are allowed, and
    /// the prefix may be left out).
    pub fn parse(text: &str) -> Result<Fingerprint, String> {
        let hex: String = text
            .trim()
            .trim_start_matches("sha256:")
            .chars()
            .filter(|c| *c != ':')
            .collect();
        let bad = || {
            format!(
                "{text:?} is not a SHA-256 fingerprint; it looks like sha256: and 64 hex digits \
                 (muster server prints it at start, and writes it to DATA_DIR/tls/ca.sha256)"
            )
        };
        if hex.len() != 64 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; 32];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Fingerprint(bytes))
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("sha256:")?;
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Certificates in PEM text.
pub fn certificates_of_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| format!("not PEM certificates: {error}"))?;
    if certificates.is_empty() {
        return Err("no certificate in it (expected -----BEGIN CERTIFICATE-----)".to_string());
    }
    Ok(certificates)
}

/// The fingerprint of the first certificate in PEM text.
pub fn fingerprint_of_pem(pem: &[u8]) -> Result<Fingerprint, String> {
    Ok(Fingerprint::of(&certificates_of_pem(pem)?[0]))
}

/// What a client trusts.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    /// CA certificates (PEM): the server's chain must lead to one of them.
    pub ca_pem: Option<Vec<u8>>,
    /// The CA's fingerprint: the server's chain must hold it (and lead to
    /// it). With `ca_pem` as well, that file's CA must have it.
    pub ca_sha256: Option<Fingerprint>,
}

impl Trust {
    pub fn is_empty(&self) -> bool {
        self.ca_pem.is_none() && self.ca_sha256.is_none()
    }
}

/// The process's cryptography (ring), installed as rustls' default once, for
/// the clients that use the system's roots.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: std::sync::OnceLock<Arc<CryptoProvider>> = std::sync::OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            let provider = rustls::crypto::ring::default_provider();
            // Another part of the process may have installed one first:
            // either is ring.
            let _ = provider.clone().install_default();
            Arc::new(provider)
        })
        .clone()
}

/// The rustls configuration for `trust`; `None` for the system's roots.
pub fn client_config(trust: &Trust) -> Result<Option<ClientConfig>, String> {
    let provider = provider();
    let verifier: Arc<dyn ServerCertVerifier> = match (&trust.ca_pem, trust.ca_sha256) {
        (None, None) => return Ok(None),
        (Some(pem), pin) => {
            let certificates = certificates_of_pem(pem)?;
            if let Some(pin) = pin
                && !certificates.iter().any(|c| Fingerprint::of(c) == pin)
            {
                return Err(format!(
                    "the CA file does not hold the CA with fingerprint {pin}"
                ));
            }
            let mut roots = RootCertStore::empty();
            for certificate in certificates {
                roots
                    .add(certificate)
                    .map_err(|error| format!("not a usable CA certificate: {error}"))?;
            }
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|error| error.to_string())?
        }
        (None, Some(pin)) => Arc::new(PinnedCa {
            pin,
            provider: provider.clone(),
        }),
    };
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| error.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Some(config))
}

/// Trusts the CA with this fingerprint, found in the server's chain.
#[derive(Debug)]
struct PinnedCa {
    pin: Fingerprint,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates
            .iter()
            .find(|certificate| Fingerprint::of(certificate) == self.pin)
        else {
            return Err(rustls::Error::General(format!(
                "the server's certificate authority is not the pinned one ({}); check the \
                 --ca-sha256 fingerprint against DATA_DIR/tls/ca.sha256 on the server",
                self.pin
            )));
        };
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|error| rustls::Error::General(error.to_string()))?;
        let others: Vec<CertificateDer<'_>> = intermediates
            .iter()
            .filter(|certificate| Fingerprint::of(certificate) != self.pin)
            .cloned()
            .collect();
        verifier.verify_server_cert(end_entity, &others, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        certificate: &CertificateDer<'_>,
        signature: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            certificate,
            signature,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        certificate: &CertificateDer<'_>,
        signature: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            certificate,
            signature,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_read_in_the_forms_people_paste() {
        let hex = "ab".repeat(32);
        let expected = Fingerprint([0xab; 32]);
        assert_eq!(Fingerprint::parse(&format!("sha256:{hex}")), Ok(expected));
        assert_eq!(Fingerprint::parse(&hex), Ok(expected));
        let colons = vec!["AB"; 32].join(":");
        assert_eq!(
            Fingerprint::parse(&format!("sha256:{colons}")),
            Ok(expected)
        );
        assert_eq!(expected.to_string(), format!("sha256:{hex}"));
        for bad in [
            "",
            "sha256:",
            "sha256:abc",
            &"zz".repeat(32),
            &"é".repeat(32),
        ] {
            let error = Fingerprint::parse(bad).expect_err(bad);
            assert!(error.contains("64 hex digits"), "{error}");
        }
    }

    #[test]
    fn a_pem_without_certificates_is_refused() {
        assert!(certificates_of_pem(b"hello").is_err());
        assert!(fingerprint_of_pem(b"").is_err());
        assert!(client_config(&Trust::default()).expect("ok").is_none());
        let error = client_config(&Trust {
            ca_pem: Some(b"no".to_vec()),
            ca_sha256: None,
        })
        .expect_err("not PEM");
        assert!(error.contains("no certificate"), "{error}");
    }
}
