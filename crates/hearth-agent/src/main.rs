//! The guest's PID 1: set up the system, then serve the agent channel forever.
//!
//! Outside a VM (not PID 1) it can serve a Unix socket for manual testing:
//! `hearth-agent --unix /tmp/agent.sock`.

use std::path::PathBuf;
use std::time::Duration;

use hearth_agent::init::{self, Cmdline};
use hearth_agent::transport::{self, DEFAULT_VSOCK_PORT, PORT_NAME};
use hearth_agent::{Agent, log};

enum Transport {
    Serial(PathBuf),
    Vsock(u32),
    Unix(PathBuf),
}

fn main() {
    let pid1 = init::is_pid1();
    if pid1 {
        init::setup();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let unix = match args.as_slice() {
        [] => None,
        [flag, path] if flag == "--unix" => Some(PathBuf::from(path)),
        _ => {
            eprintln!(
                "usage: hearth-agent [--unix PATH]   (as PID 1: configured by the kernel command line)"
            );
            std::process::exit(2);
        }
    };
    let agent = Agent::new();
    loop {
        // If PID 1 returned, the kernel would panic: contain every failure and start over.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&agent, unix.clone())));
        match result {
            Ok(Ok(())) => log("transport loop ended"),
            Ok(Err(e)) => log(&format!("fatal: {e}")),
            Err(_) => log("panic in the agent; restarting"),
        }
        if !pid1 {
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn run(agent: &Agent, unix: Option<PathBuf>) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(8)
        .build()?;
    rt.block_on(async {
        let transport = match unix {
            Some(p) => Transport::Unix(p),
            None => choose_transport(&Cmdline::read()).await,
        };
        match transport {
            Transport::Serial(path) => {
                log(&format!("serving {PORT_NAME} on {}", path.display()));
                transport::serve_serial(agent, &path).await
            }
            Transport::Vsock(port) => transport::serve_vsock(agent, port).await,
            Transport::Unix(path) => {
                let _ = std::fs::remove_file(&path);
                let listener = tokio::net::UnixListener::bind(&path)?;
                loop {
                    let (conn, _) = listener.accept().await?;
                    let agent = agent.clone();
                    tokio::spawn(async move {
                        if let Err(e) = agent.serve(conn).await {
                            log(&format!("session: {e}"));
                        }
                    });
                }
            }
        }
    })
}

/// `hearth.transport=` decides; without it, serial when the named virtio port exists (it may take a moment
/// to appear), else vsock.
async fn choose_transport(cmdline: &Cmdline) -> Transport {
    let port = cmdline.vsock_port.unwrap_or(DEFAULT_VSOCK_PORT);
    match cmdline.transport.as_deref() {
        Some("vsock") => return Transport::Vsock(port),
        Some("serial") => {
            if transport::find_virtio_port(PORT_NAME).is_none() {
                log(&format!("waiting for virtio port {PORT_NAME}"));
            }
            loop {
                if let Some(p) = transport::find_virtio_port(PORT_NAME) {
                    return Transport::Serial(p);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Some(other) => log(&format!("unknown hearth.transport={other}; detecting")),
        None => {}
    }
    for _ in 0..5 {
        if let Some(p) = transport::find_virtio_port(PORT_NAME) {
            return Transport::Serial(p);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Transport::Vsock(port)
}
