//! The job token and the HMAC challenge-response that proves knowledge of it.
//!
//! Each side sends a fresh random nonce and answers the other's with
//! `HMAC-SHA256(token, label || server_nonce || client_nonce || role || rank)`, so the
//! token never crosses the wire and a recorded proof is useless for another connection.

use std::fmt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

use crate::cluster::Role;
use crate::message::{NONCE_LEN, PROOF_LEN};

/// Environment variable holding the job token.
pub const TOKEN_ENV: &str = "SUMFLOW_JOB_TOKEN";
/// Environment variable naming a file that holds the job token.
pub const TOKEN_FILE_ENV: &str = "SUMFLOW_JOB_TOKEN_FILE";
/// Shorter tokens are refused: they would be guessable.
pub const MIN_TOKEN_LEN: usize = 16;

type HmacSha256 = Hmac<Sha256>;

#[derive(Debug, Error)]
pub enum TokenError {
    #[error(
        "no job token: set {TOKEN_ENV} (or {TOKEN_FILE_ENV}, or --token-file) to the job's \
         shared secret; sumflow-run generates one per job"
    )]
    Missing,
    #[error("job token is {len} bytes; it must be at least {MIN_TOKEN_LEN}")]
    TooShort { len: usize },
    #[error("cannot read job token file {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot draw random bytes from the operating system: {0}")]
    Random(String),
}

/// The job's shared secret. Its `Debug` output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(Vec<u8>);

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobToken(<{} bytes redacted>)", self.0.len())
    }
}

impl JobToken {
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<JobToken, TokenError> {
        let secret = secret.into();
        if secret.len() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort { len: secret.len() });
        }
        Ok(JobToken(secret))
    }

    /// A fresh 256-bit token, hex encoded so it can travel in an environment variable.
    pub fn generate() -> Result<JobToken, TokenError> {
        Ok(JobToken(hex::encode(random_bytes::<32>()?).into_bytes()))
    }

    /// The token as text, for handing to child processes.
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// Loads the token from `file` if given, else from `SUMFLOW_JOB_TOKEN_FILE`, else from
    /// `SUMFLOW_JOB_TOKEN`. A file's trailing newline is not part of the token.
    pub fn load(file: Option<&Path>) -> Result<JobToken, TokenError> {
        let file = file
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os(TOKEN_FILE_ENV).map(PathBuf::from));
        if let Some(path) = file {
            let text = std::fs::read(&path).map_err(|source| TokenError::File {
                path: path.clone(),
                source,
            })?;
            let trimmed = text.trim_ascii_end().to_vec();
            return JobToken::new(trimmed);
        }
        match std::env::var_os(TOKEN_ENV) {
            Some(v) if !v.is_empty() => JobToken::new(v.into_encoded_bytes()),
            _ => Err(TokenError::Missing),
        }
    }

    fn client_mac(&self, hs: &Handshake) -> HmacSha256 {
        let id = hs.identity();
        self.mac(&[b"sumflow/1 client", &hs.server_nonce, &hs.client_nonce, &id])
    }

    fn server_mac(&self, hs: &Handshake) -> HmacSha256 {
        self.mac(&[b"sumflow/1 server", &hs.client_nonce, &hs.server_nonce])
    }

    fn mac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC accepts any key length");
        for p in parts {
            mac.update(p);
        }
        mac
    }

    /// The client's proof, binding both nonces and the identity it claims.
    pub fn client_proof(&self, hs: &Handshake) -> [u8; PROOF_LEN] {
        self.client_mac(hs).finalize().into_bytes().into()
    }

    pub fn verify_client(&self, hs: &Handshake, proof: &[u8; PROOF_LEN]) -> bool {
        self.client_mac(hs).verify_slice(proof).is_ok()
    }

    /// The server's proof, so a client never talks to an impostor.
    pub fn server_proof(&self, hs: &Handshake) -> [u8; PROOF_LEN] {
        self.server_mac(hs).finalize().into_bytes().into()
    }

    pub fn verify_server(&self, hs: &Handshake, proof: &[u8; PROOF_LEN]) -> bool {
        self.server_mac(hs).verify_slice(proof).is_ok()
    }
}

/// The values both proofs of one connection are computed over.
#[derive(Debug)]
pub struct Handshake {
    pub server_nonce: [u8; NONCE_LEN],
    pub client_nonce: [u8; NONCE_LEN],
    pub role: Role,
    pub rank: Option<u32>,
}

impl Handshake {
    fn identity(&self) -> [u8; 5] {
        let mut id = [0u8; 5];
        id[0] = self.role as u8;
        id[1..].copy_from_slice(&self.rank.unwrap_or(u32::MAX).to_le_bytes());
        id
    }
}

/// Fresh random bytes from the operating system.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], TokenError> {
    let mut out = [0u8; N];
    getrandom::getrandom(&mut out).map_err(|e| TokenError::Random(e.to_string()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs() -> Handshake {
        Handshake {
            server_nonce: [1; 32],
            client_nonce: [2; 32],
            role: Role::Worker,
            rank: Some(3),
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_token_and_identity() {
        let t = JobToken::new("0123456789abcdef-secret").unwrap();
        let other = JobToken::new("0123456789abcdef-SECRET").unwrap();
        let p = t.client_proof(&hs());
        assert!(t.verify_client(&hs(), &p));
        assert!(!other.verify_client(&hs(), &p));
        let mut h = hs();
        h.rank = Some(4);
        assert!(
            !t.verify_client(&h, &p),
            "proof is bound to the claimed rank"
        );
        let sp = t.server_proof(&hs());
        assert!(t.verify_server(&hs(), &sp));
        assert_ne!(sp, p, "client and server proofs differ");
    }

    #[test]
    fn short_tokens_are_refused_and_debug_is_redacted() {
        assert!(matches!(
            JobToken::new("short"),
            Err(TokenError::TooShort { len: 5 })
        ));
        let t = JobToken::generate().unwrap();
        assert_eq!(t.as_str().unwrap().len(), 64);
        assert!(!format!("{t:?}").contains(t.as_str().unwrap()));
    }
}
