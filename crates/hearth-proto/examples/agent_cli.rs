//! Talk to an agent channel directly (a developer tool, e.g. on a QEMU `agent.sock`):
//!
//! ```text
//! cargo run -p hearth-proto --example agent_cli -- SOCKET ping
//! cargo run -p hearth-proto --example agent_cli -- SOCKET sh 'uname -a'
//! cargo run -p hearth-proto --example agent_cli -- SOCKET bg 'sleep 100'
//! cargo run -p hearth-proto --example agent_cli -- SOCKET ps
//! cargo run -p hearth-proto --example agent_cli -- SOCKET cat /etc/hostname
//! ```

use std::io::Write;
use std::time::Duration;

use futures::StreamExt;
use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [sock, cmd, rest @ ..] = args.as_slice() else {
        eprintln!("usage: agent_cli SOCKET ping|sh LINE|bg LINE|ps|wait PID|cat PATH");
        std::process::exit(2);
    };
    let stream = tokio::net::UnixStream::connect(sock).await?;
    let c = AgentClient::connect(stream, Duration::from_secs(10)).await?;
    eprintln!("connected to agent {}", c.agent_version());
    match (cmd.as_str(), rest) {
        ("ping", []) => {
            let t = std::time::Instant::now();
            c.ping().await?;
            println!("pong in {:?}", t.elapsed());
        }
        ("sh", [line]) => {
            let mut h = c.exec(ExecRequest::shell(line.clone())).await?;
            while let Some(ev) = h.next_event().await {
                match ev {
                    ExecEvent::Stdout(d) => std::io::stdout().write_all(&d)?,
                    ExecEvent::Stderr(d) => std::io::stderr().write_all(&d)?,
                    ExecEvent::Exited {
                        code,
                        signal,
                        timed_out,
                    } => {
                        eprintln!("exited: code={code:?} signal={signal:?} timed_out={timed_out}");
                        std::process::exit(code.unwrap_or(128));
                    }
                    ExecEvent::Error(e) => return Err(e.into()),
                }
            }
        }
        ("bg", [line]) => println!("{}", c.spawn_background(ExecRequest::shell(line.clone())).await?),
        ("ps", []) => {
            for p in c.list_processes().await? {
                println!(
                    "{}\t{}\t{:?}\t{}",
                    p.pid,
                    if p.background { "bg" } else { "fg" },
                    p.exit,
                    p.cmd
                );
            }
        }
        ("wait", [pid]) => {
            let exit = c.wait_process(pid.parse()?).await?;
            std::io::stdout().write_all(&exit.stdout_tail)?;
            std::io::stderr().write_all(&exit.stderr_tail)?;
            eprintln!("exited: code={:?} signal={:?}", exit.code, exit.signal);
        }
        ("cat", [path]) => {
            let (_, mut r) = c.read_file(path).await?;
            while let Some(chunk) = r.next().await {
                std::io::stdout().write_all(&chunk?)?;
            }
        }
        _ => {
            eprintln!("unknown command");
            std::process::exit(2);
        }
    }
    Ok(())
}
