//! Where the store lives and how to reach it: `s3://BUCKET/PREFIX` plus endpoint, region and credentials taken
//! the way AWS tools take them. Secrets are wrapped in [`Secret`], whose `Debug` prints `<redacted>`.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::ConfigError;

/// Default chunk size (256 KiB): see the crate README for the measurement behind it.
pub const DEFAULT_CHUNK_SIZE: usize = 256 << 10;

/// A string that must never be printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value, for the one place that signs requests with it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Static S3 credentials.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// `AWS_ACCESS_KEY_ID` (an identifier, not a secret, but still kept out of messages).
    pub access_key_id: String,
    /// `AWS_SECRET_ACCESS_KEY`.
    pub secret_access_key: Secret,
    /// `AWS_SESSION_TOKEN`, for temporary credentials.
    pub session_token: Option<Secret>,
}

/// The 32-byte client-side encryption key. `Debug` prints `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreKey(pub(crate) [u8; 32]);

impl StoreKey {
    /// A key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> StoreKey {
        StoreKey(bytes)
    }

    /// Reads a key file: either 64 hexadecimal characters (surrounding whitespace and a final newline allowed),
    /// or exactly 32 raw bytes. `head -c 32 /dev/urandom > key` and `openssl rand -hex 32 > key` both make one.
    pub fn from_file(path: &Path) -> Result<StoreKey, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Io {
            path: path.to_owned(),
            source,
        })?;
        let bad = || ConfigError::BadKeyFile(path.to_owned());
        if let Ok(text) = std::str::from_utf8(&bytes)
            && text.trim().len() == 64
        {
            let mut key = [0u8; 32];
            hex::decode_to_slice(text.trim(), &mut key).map_err(|_| bad())?;
            return Ok(StoreKey(key));
        }
        let key: [u8; 32] = bytes.as_slice().try_into().map_err(|_| bad())?;
        Ok(StoreKey(key))
    }
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreKey(<redacted>)")
    }
}

/// How to reach the store and how it behaves. Build it with [`StoreConfig::from_url`] and adjust fields.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The bucket.
    pub bucket: String,
    /// The key prefix everything lives under (no leading or trailing `/`; empty for the bucket's root).
    pub prefix: String,
    /// A custom endpoint (`AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`): MinIO, R2, a test server. `None` is AWS.
    pub endpoint: Option<String>,
    /// The region (`AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's `region`; default `us-east-1`; R2 uses
    /// `auto`).
    pub region: String,
    /// Static credentials.
    pub credentials: Credentials,
    /// Path-style addressing (`http://endpoint/bucket/key`), which MinIO-like servers need. `from_url` turns it
    /// on whenever an endpoint is given (set `AWS_S3_ADDRESSING_STYLE=virtual` to keep virtual-hosted style).
    pub path_style: bool,
    /// Allow plain `http://`; `from_url` allows it only for an explicit `http://` endpoint.
    pub allow_http: bool,
    /// Client-side encryption key; `None` stores plaintext chunks.
    pub key: Option<StoreKey>,
    /// Chunk size for new uploads (existing manifests keep theirs).
    pub chunk_size: usize,
    /// Parallel requests per upload or download.
    pub concurrency: usize,
    /// Retries of one retryable request (connection errors, 5xx, timeouts) with exponential backoff and jitter.
    pub max_retries: usize,
    /// Upper bound on the time spent retrying one request.
    pub retry_timeout: Duration,
    /// Timeout of one HTTP request.
    pub request_timeout: Duration,
}

impl StoreConfig {
    /// Parses `s3://BUCKET[/PREFIX]` and takes endpoint, region and credentials from the process environment
    /// and the shared credentials file, as AWS tools do.
    pub fn from_url(url: &str) -> Result<StoreConfig, ConfigError> {
        StoreConfig::from_url_with_env(url, |name| std::env::var(name).ok())
    }

    /// [`StoreConfig::from_url`] with an explicit environment (for tests and embedding).
    pub fn from_url_with_env(
        url: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<StoreConfig, ConfigError> {
        let (bucket, prefix) = parse_url(url)?;
        let env = |name: &str| env(name).filter(|v| !v.is_empty());
        let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".to_owned());
        let home = env("HOME").map(PathBuf::from);
        let config_file = env("AWS_CONFIG_FILE")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws/config")));
        let config_section = if profile == "default" {
            "default".to_owned()
        } else {
            format!("profile {profile}")
        };
        let profile_config = config_file
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|text| parse_ini(&text).remove(&config_section))
            .unwrap_or_default();

        let endpoint = env("AWS_ENDPOINT_URL_S3")
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| profile_config.get("endpoint_url").cloned());
        if let Some(e) = &endpoint
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return Err(ConfigError::BadEndpoint(e.clone()));
        }
        let region = env("AWS_REGION")
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .or_else(|| profile_config.get("region").cloned())
            .unwrap_or_else(|| "us-east-1".to_owned());
        let credentials = credentials(&env, &profile, home.as_deref())?;
        let virtual_hosted = env("AWS_S3_ADDRESSING_STYLE").is_some_and(|s| s == "virtual");
        Ok(StoreConfig {
            bucket,
            prefix,
            path_style: endpoint.is_some() && !virtual_hosted,
            allow_http: endpoint.as_deref().is_some_and(|e| e.starts_with("http://")),
            endpoint,
            region,
            credentials,
            key: None,
            chunk_size: DEFAULT_CHUNK_SIZE,
            concurrency: 32,
            max_retries: 6,
            retry_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
        })
    }

    /// `s3://BUCKET/PREFIX`, for messages (no credentials in it).
    pub fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    /// Removes every configured secret (and the access key id) from a message meant for humans.
    pub fn scrub(&self, message: &str) -> String {
        let mut out = message.to_owned();
        let c = &self.credentials;
        let mut secrets = vec![c.secret_access_key.expose(), c.access_key_id.as_str()];
        if let Some(t) = &c.session_token {
            secrets.push(t.expose());
        }
        for s in secrets.into_iter().filter(|s| s.len() >= 4) {
            out = out.replace(s, "<redacted>");
        }
        out
    }
}

/// Whether `name` follows S3's bucket naming: 3-63 characters of a-z, 0-9, '-' and '.', starting and ending
/// with a letter or digit.
pub fn is_valid_bucket_name(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.'))
        && !name.starts_with(['-', '.'])
        && !name.ends_with(['-', '.'])
}

fn parse_url(url: &str) -> Result<(String, String), ConfigError> {
    let bad = |reason| ConfigError::BadUrl {
        url: url.chars().take(200).collect(),
        reason,
    };
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| bad("expected s3://BUCKET[/PREFIX]"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if !is_valid_bucket_name(bucket) {
        return Err(bad("bucket names are 3-63 characters of a-z, 0-9, '-' and '.'"));
    }
    let prefix = prefix.trim_end_matches('/');
    if !prefix.is_empty() && crate::ObjectName::new(prefix).is_err() {
        return Err(bad(
            "the prefix follows the object name rules: a-z 0-9 _ - . / without '..'",
        ));
    }
    Ok((bucket.to_owned(), prefix.to_owned()))
}

fn credentials(
    env: &impl Fn(&str) -> Option<String>,
    profile: &str,
    home: Option<&Path>,
) -> Result<Credentials, ConfigError> {
    if let (Some(id), Some(secret)) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
        return Ok(Credentials {
            access_key_id: id,
            secret_access_key: Secret(secret),
            session_token: env("AWS_SESSION_TOKEN").map(Secret),
        });
    }
    let path = env("AWS_SHARED_CREDENTIALS_FILE")
        .map(PathBuf::from)
        .or_else(|| home.map(|h| h.join(".aws/credentials")))
        .ok_or(ConfigError::NoCredentials)?;
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ConfigError::NoCredentials),
        Err(source) => return Err(ConfigError::Io { path, source }),
    };
    let mut sections = parse_ini(&text);
    let no_profile = || ConfigError::NoProfile {
        profile: profile.to_owned(),
        path: path.clone(),
    };
    let mut section = sections.remove(profile).ok_or_else(no_profile)?;
    let (Some(id), Some(secret)) = (
        section.remove("aws_access_key_id"),
        section.remove("aws_secret_access_key"),
    ) else {
        return Err(no_profile());
    };
    Ok(Credentials {
        access_key_id: id,
        secret_access_key: Secret(secret),
        session_token: section.remove("aws_session_token").map(Secret),
    })
}

/// The INI dialect of `~/.aws/credentials` and `~/.aws/config`: `[section]`, `key = value`, `#`/`;` comments.
fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut current: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = Some(name.trim().to_owned());
            continue;
        }
        if let (Some(section), Some((k, v))) = (&current, line.split_once('=')) {
            out.entry(section.clone())
                .or_default()
                .insert(k.trim().to_owned(), v.trim().to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn url_and_env() {
        let env = env_of(&[
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"),
            ("AWS_DEFAULT_REGION", "eu-west-3"),
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", "very-secret-value"),
            ("AWS_SESSION_TOKEN", "token-value"),
        ]);
        let c = StoreConfig::from_url_with_env("s3://my-bucket/hearth/prod/", env).expect("config");
        assert_eq!(
            (c.bucket.as_str(), c.prefix.as_str()),
            ("my-bucket", "hearth/prod")
        );
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(c.region, "eu-west-3");
        assert!(c.path_style && c.allow_http);
        let debug = format!("{c:?}");
        assert!(
            !debug.contains("very-secret-value") && !debug.contains("token-value"),
            "{debug}"
        );
        assert_eq!(
            c.scrub("sig very-secret-value by AKIDEXAMPLE"),
            "sig <redacted> by <redacted>"
        );
    }

    #[test]
    fn aws_defaults_and_bad_urls() {
        let env = env_of(&[("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b")]);
        let c = StoreConfig::from_url_with_env("s3://bucket", &env).expect("config");
        assert!(c.prefix.is_empty() && c.endpoint.is_none() && !c.path_style && !c.allow_http);
        assert_eq!(c.region, "us-east-1");
        for bad in [
            "http://bucket/x",
            "s3://",
            "s3://B",
            "s3://ab",
            "s3://bucket/../x",
            "s3://bucket/a//b",
        ] {
            assert!(StoreConfig::from_url_with_env(bad, &env).is_err(), "{bad}");
        }
        let e = env_of(&[("AWS_ENDPOINT_URL", "ftp://x")]);
        assert!(matches!(
            StoreConfig::from_url_with_env("s3://bucket", e),
            Err(ConfigError::BadEndpoint(_))
        ));
    }

    #[test]
    fn shared_credentials_file_and_profiles() {
        let dir = tempfile::tempdir().expect("tempdir");
        let creds = dir.path().join("credentials");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = D\naws_secret_access_key = dsecret\n\n# comment\n[work]\n\
             aws_access_key_id=W\naws_secret_access_key=wsecret\naws_session_token = wtoken\n",
        )
        .expect("write");
        let config = dir.path().join("config");
        std::fs::write(
            &config,
            "[profile work]\nregion = auto\nendpoint_url = https://acc.r2.example\n",
        )
        .expect("w");
        let file = creds.to_str().expect("utf8");
        let cfg = config.to_str().expect("utf8");
        let env = env_of(&[("AWS_SHARED_CREDENTIALS_FILE", file), ("AWS_CONFIG_FILE", cfg)]);
        let c = StoreConfig::from_url_with_env("s3://bucket", env).expect("default");
        assert_eq!(c.credentials.access_key_id, "D");
        let env = env_of(&[
            ("AWS_SHARED_CREDENTIALS_FILE", file),
            ("AWS_CONFIG_FILE", cfg),
            ("AWS_PROFILE", "work"),
        ]);
        let c = StoreConfig::from_url_with_env("s3://bucket", env).expect("work");
        assert_eq!(c.credentials.secret_access_key.expose(), "wsecret");
        assert_eq!(
            c.credentials.session_token.as_ref().map(Secret::expose),
            Some("wtoken")
        );
        assert_eq!(
            (c.region.as_str(), c.endpoint.as_deref()),
            ("auto", Some("https://acc.r2.example"))
        );
        assert!(c.path_style && !c.allow_http);
        let env = env_of(&[("AWS_SHARED_CREDENTIALS_FILE", file), ("AWS_PROFILE", "nope")]);
        assert!(matches!(
            StoreConfig::from_url_with_env("s3://bucket", env),
            Err(ConfigError::NoProfile { .. })
        ));
        let env = env_of(&[("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/creds")]);
        assert!(matches!(
            StoreConfig::from_url_with_env("s3://bucket", env),
            Err(ConfigError::NoCredentials)
        ));
    }

    #[test]
    fn key_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let hex_file = dir.path().join("hex");
        std::fs::write(&hex_file, format!("{}\n", "ab".repeat(32))).expect("write");
        assert_eq!(StoreKey::from_file(&hex_file).expect("hex").0, [0xab; 32]);
        let raw = dir.path().join("raw");
        std::fs::write(&raw, [7u8; 32]).expect("write");
        assert_eq!(StoreKey::from_file(&raw).expect("raw").0, [7; 32]);
        let short = dir.path().join("short");
        std::fs::write(&short, "abcd").expect("write");
        assert!(matches!(
            StoreKey::from_file(&short),
            Err(ConfigError::BadKeyFile(_))
        ));
        assert_eq!(format!("{:?}", StoreKey([1; 32])), "StoreKey(<redacted>)");
    }
}
