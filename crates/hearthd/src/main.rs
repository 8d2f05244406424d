use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = hearthd::config::Args::parse();
    if args.print_openapi {
        print!("{}", hearthd::openapi::document_json());
        return Ok(());
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    hearthd::daemon::serve(args).await
}
