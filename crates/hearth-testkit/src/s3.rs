//! Real S3-compatible servers for tests, started on 127.0.0.1 with a free port and a temporary directory:
//! `s3s-fs` (checks SigV4 signatures, keeps objects as plain files under [`S3Server::data_dir`]) and
//! `moto_server` (AWS semantics, in memory, accepts any credentials). `scripts/install-test-deps.sh` installs
//! both; a missing binary fails the test with that instruction.
//!
//! The server is killed on drop. [`S3Server::stop`] / [`S3Server::start_again`] make an outage on the same port
//! (s3s-fs keeps its data; moto restarts empty), [`S3Server::freeze`] / [`S3Server::thaw`] make a server that
//! accepts connections but never answers (SIGSTOP / SIGCONT).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which implementation to start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum S3Kind {
    /// `s3s-fs`: SigV4 checked, objects persisted as files.
    S3sFs,
    /// `moto_server`: AWS semantics, in memory, any credentials accepted.
    Moto,
}

impl S3Kind {
    /// Both kinds, for tests that run against each.
    pub const ALL: [S3Kind; 2] = [S3Kind::S3sFs, S3Kind::Moto];

    /// The server's executable: `$HEARTH_S3S_FS` / `$HEARTH_MOTO_SERVER` if set, else where
    /// `scripts/install-test-deps.sh` installs it (the KVM test host stages `s3s-fs` into its VM by this path).
    pub fn binary(self) -> PathBuf {
        let (var, installed, name) = match self {
            S3Kind::S3sFs => ("HEARTH_S3S_FS", "/opt/hearth/test-tools/bin/s3s-fs", "s3s-fs"),
            S3Kind::Moto => (
                "HEARTH_MOTO_SERVER",
                "/opt/hearth/test-tools/venv/bin/moto_server",
                "moto_server",
            ),
        };
        if let Some(path) = std::env::var_os(var) {
            return PathBuf::from(path);
        }
        let installed = PathBuf::from(installed);
        assert!(
            installed.is_file(),
            "{name} is not installed at {}: run `bash scripts/install-test-deps.sh` as root (or set {var})",
            installed.display()
        );
        installed
    }
}

/// The access key id the servers are started with.
pub const ACCESS_KEY_ID: &str = "hearthtestkey";
/// The secret access key the servers are started with (a test value, not a secret).
pub const SECRET_ACCESS_KEY: &str = "hearth-test-secret-0123456789";
/// The region the environment names (both servers accept any).
pub const REGION: &str = "us-east-1";

/// A running S3-compatible server with one bucket.
pub struct S3Server {
    kind: S3Kind,
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    bucket: String,
}

impl S3Server {
    /// Starts `kind` on a free loopback port with an empty bucket named `bucket`.
    pub fn start(kind: S3Kind, bucket: &str) -> S3Server {
        let dir = tempfile::Builder::new()
            .prefix("hearth-s3-")
            .tempdir()
            .expect("a temporary directory for the S3 server");
        std::fs::create_dir_all(dir.path().join("data")).expect("the data directory");
        let port = free_port();
        let mut server = S3Server {
            kind,
            port,
            dir,
            child: None,
            bucket: bucket.to_owned(),
        };
        server.start_again();
        server.create_bucket(bucket);
        server
    }

    /// The implementation running.
    pub fn kind(&self) -> S3Kind {
        self.kind
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The bucket created at start.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// `s3://BUCKET/PREFIX` (or `s3://BUCKET` for an empty prefix).
    pub fn url(&self, prefix: &str) -> String {
        if prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{prefix}", self.bucket)
        }
    }

    /// The environment an AWS tool (or hearthd) needs to reach this server.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_REGION", REGION.to_owned()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Where s3s-fs keeps the objects (`<data_dir>/<bucket>/<key>` as plain files); `None` for moto (in memory).
    pub fn data_dir(&self) -> Option<PathBuf> {
        (self.kind == S3Kind::S3sFs).then(|| self.dir.path().join("data"))
    }

    /// Where the server's stdout and stderr go.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Creates another bucket.
    pub fn create_bucket(&self, bucket: &str) {
        match self.kind {
            // s3s-fs keeps a bucket as a directory under its root.
            S3Kind::S3sFs => {
                std::fs::create_dir_all(self.dir.path().join("data").join(bucket)).expect("bucket dir")
            }
            // moto accepts unsigned requests.
            S3Kind::Moto => {
                let answer = http_request(
                    self.addr(),
                    &format!("PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1\r\n"),
                );
                assert!(
                    answer.starts_with("HTTP/1.1 200"),
                    "moto refused CreateBucket: {answer}"
                );
            }
        }
    }

    /// Kills the server (SIGKILL) and waits for it; the port stays reserved for [`S3Server::start_again`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// (Re)starts the server on the same port and data directory and waits until it accepts connections.
    pub fn start_again(&mut self) {
        self.stop();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the server log");
        let mut cmd = Command::new(self.kind.binary());
        match self.kind {
            S3Kind::S3sFs => {
                cmd.args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
                    .args(["--access-key", ACCESS_KEY_ID, "--secret-key", SECRET_ACCESS_KEY])
                    .arg(self.dir.path().join("data"));
            }
            S3Kind::Moto => {
                cmd.args(["-H", "127.0.0.1", "-p", &self.port.to_string()]);
            }
        }
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .env("RUST_LOG", "warn");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {:?}: {e}", self.kind));
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(60));
    }

    /// Stops the process without closing its socket (SIGSTOP): connections are accepted by the kernel and then
    /// hang, as on a frozen or overloaded server. Returns once every thread of the server has stopped: kill(2)
    /// only queues the stop, and until the thread it woke has run, another thread can still answer a request
    /// (seen in CI, on a loaded machine).
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
        let pid = self.child.as_ref().expect("the server runs").id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_threads_stopped(pid) {
            assert!(
                Instant::now() < deadline,
                "the S3 server did not stop within 10 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Resumes a frozen server (SIGCONT).
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        let child = self.child.as_ref().expect("the server runs");
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits");
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "signalling the S3 server");
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                panic!("{:?} exited at start ({status}):\n{log}", self.kind);
            }
            if TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_ok() {
                // moto's HTTP server binds before it can answer; an answered request is the real signal.
                let answer = http_request(self.addr(), "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n");
                if answer.starts_with("HTTP/1.1 ") {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{:?} did not start within {timeout:?}",
                self.kind
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_ref() {
            // A frozen process cannot die from SIGKILL until it is continued on some kernels: thaw first.
            // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGCONT) };
        }
        self.stop();
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; the server binds it right after).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// Sends one small HTTP/1.1 request (head lines without the final blank line) and returns the start of the
/// answer, or an empty string on any error.
fn http_request(addr: SocketAddr, head: &str) -> String {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("{head}Content-Length: 0\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return String::new();
    }
    let mut answer = Vec::new();
    let _ = stream.take(4096).read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// Every regular file under `dir`, recursively (for tests that search a server's on-disk objects).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(t) if t.is_file() => out.push(path),
                _ => {}
            }
        }
    }
    out
}

/// Whether every thread of process `pid` is in the stopped state (`T` in `/proc/PID/task/TID/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may itself hold ") ".
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    })
}
