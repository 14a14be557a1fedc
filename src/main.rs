//! `presenced`: the presence database server.
//!
//! This binary only reads configuration, installs logging and signal handling,
//! binds the listener and hands over to [`presence_server::serve`]; the client
//! subcommands (`get`, `watch`, ...) are handed to [`presence_cli::run`].

mod config;

use std::io::Write as _;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tokio::net::TcpListener;

use crate::config::ServeArgs;

#[derive(Debug, Parser)]
#[command(
    name = "presenced",
    version,
    about = "An in-memory presence database: session leases in, ONLINE/OFFLINE out."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// What `presenced --help` says after the commands, before the exit
/// statuses: the flags every client command takes.
const CLIENT_FLAGS: &str = "\
Every client command (get, watch, changes, sessions, revoke, room, stats, export, erase, backup,
register) takes:
  --addr ADDR        the server: HOST[:PORT], http://... or https://... (PRESENCED_ADDR;
                     default 127.0.0.1:50051)
  --token TOKEN      a service token or a viewer's JWT (PRESENCED_TOKEN), or
  --token-file FILE  the token read from a file (PRESENCED_TOKEN_FILE)
  --ca FILE          the CA of an https:// server (--cert and --key for mutual TLS)
  --json             JSON output
`presenced COMMAND --help` says more.
";

// One value per process, parsed once: the size of `serve`'s arguments costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service (in memory, on 127.0.0.1:50051 unless told otherwise).
    Serve(ServeArgs),
    /// Service credentials for the credentials file (`serve --credentials`).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Certificates for development, and the flags that serve and call with them.
    ///
    /// Writes into DIR a CA, a server certificate for 127.0.0.1, ::1,
    /// localhost (and each --name), a client certificate, and a cluster CA
    /// with peer certificates for three nodes; prints the flags that use them.
    DevCerts(DevCertsArgs),
    // The operator's tools, each a client of a running service.
    #[command(flatten)]
    Client(presence_cli::Command),
}

/// `presenced token ...`
#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Make a fresh token for a credential NAME: the entry on stdout, the token on stderr.
    ///
    /// Prints the entry to append to the credentials file (which holds only
    /// the token's SHA-256) on stdout, and the token on stderr, or into
    /// --token-file: give it to the caller; it is shown once.
    New(TokenNewArgs),
}

/// `presenced token new NAME --scope SCOPE...`
#[derive(Debug, clap::Args)]
struct TokenNewArgs {
    /// The credential's name, as the audit log and refusals show it.
    #[arg(value_name = "NAME")]
    name: String,
    /// A scope of the credential; repeat it or separate with commas:
    /// gateway, read, read-as-viewer, admin, feed, cluster.
    #[arg(long = "scope", value_name = "SCOPE", value_delimiter = ',', required = true, value_parser = parse_scope)]
    scopes: Vec<presence_server::Scope>,
    /// Write the token to FILE (made readable by its owner only; not one
    /// that exists) instead of stderr.
    #[arg(long = "token-file", value_name = "FILE")]
    token_file: Option<std::path::PathBuf>,
}

/// `presenced dev-certs DIR [--name NAME ...]`
#[derive(Debug, clap::Args)]
struct DevCertsArgs {
    /// The directory to write them to (made if missing; no file of the set may be there yet).
    #[arg(value_name = "DIR")]
    dir: std::path::PathBuf,
    /// Another name the server and peer certificates cover: a DNS name or an
    /// IP address clients dial (repeat it for several).
    #[arg(long = "name", value_name = "NAME")]
    names: Vec<String>,
}

fn run_dev_certs(args: DevCertsArgs) -> Result<(), String> {
    let certs = presence_tls::dev_certs::write(&args.dir, &args.names).map_err(|err| err.to_string())?;
    print!("{}", dev_certs_usage(&certs));
    Ok(())
}

/// What `dev-certs` made and the flags that use it, as it prints them.
fn dev_certs_usage(certs: &presence_tls::dev_certs::DevCerts) -> String {
    let path = |path: &std::path::Path| path.display().to_string();
    let (node, node_cert, node_key) = &certs.nodes[0];
    let nodes: Vec<&str> = certs.nodes.iter().map(|(node, _, _)| node.as_str()).collect();
    format!(
        "Development certificates (X.509 v3; not for production), covering {names}:\n\
         \n\
         TLS (callers prove themselves with tokens):\n\
         \x20 presenced serve --tls-cert {server} --tls-key {server_key}\n\
         \x20 presenced stats --addr https://127.0.0.1:50051 --ca {ca}\n\
         \n\
         Mutual TLS (a gateway's certificate makes it a service caller without a token):\n\
         \x20 presenced serve --tls-cert {server} --tls-key {server_key} \\\n\
         \x20   --tls-client-ca {ca} --tls-service-identity {identity}\n\
         \x20 presenced stats --addr https://127.0.0.1:50051 --ca {ca} --cert {client} --key {client_key}\n\
         \n\
         A cluster node ({node}; also {others}), beside the flags above:\n\
         \x20 presenced serve ... --peer-tls-cert {node_cert} --peer-tls-key {node_key} --peer-tls-ca {cluster_ca}\n",
        names = certs.names.join(", "),
        server = path(&certs.server.0),
        server_key = path(&certs.server.1),
        ca = path(&certs.ca),
        identity = presence_tls::dev_certs::CLIENT_IDENTITY,
        client = path(&certs.client.0),
        client_key = path(&certs.client.1),
        others = nodes[1..].join(", "),
        node_cert = path(node_cert),
        node_key = path(node_key),
        cluster_ca = path(&certs.cluster_ca),
    )
}

fn parse_scope(name: &str) -> Result<presence_server::Scope, String> {
    presence_server::Scope::parse(name).ok_or_else(|| {
        let known: Vec<&str> = presence_server::Scope::ALL.iter().map(|scope| scope.name()).collect();
        format!("unknown scope {name:?}; the scopes are {}", known.join(", "))
    })
}

fn run_token(command: TokenCommand) -> Result<(), String> {
    let TokenCommand::New(args) = command;
    let token = presence_server::new_token().map_err(|err| format!("cannot read the system's random source: {err}"))?;
    let entry = presence_server::entry_for(&args.name, &args.scopes, &token)?;
    // stdout is the entry alone, so that `token new ... >> credentials.toml`
    // appends what the file may hold and never the secret.
    match &args.token_file {
        Some(path) => write_secret(path, &format!("{token}\n"))
            .map_err(|err| format!("--token-file {}: cannot write: {err}", path.display()))?,
        None => eprintln!("{token}"),
    }
    print!("{entry}");
    Ok(())
}

/// Writes `text` to a new file at `path` that only its owner may read.
fn write_secret(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(text.as_bytes())
}

fn main() -> ExitCode {
    // `serve`'s help shows the library's defaults, read from it at run time.
    let command = Cli::command()
        .after_help(format!("{CLIENT_FLAGS}\n{}", presence_cli::EXIT_CODES))
        .mut_subcommand("serve", config::with_defaults_in_help);
    let cli = match command.try_get_matches().and_then(|matches| Cli::from_arg_matches(&matches)) {
        Ok(cli) => cli,
        Err(err) if !err.use_stderr() => err.exit(), // --help, --version
        // A bad value for a setting is a refused configuration: one line
        // naming the flag (B7), as every other refused setting is.
        Err(err) if matches!(err.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) => {
            eprintln!("presenced: {}", one_line(&err));
            return ExitCode::from(2);
        }
        // A command line of the wrong shape (a missing argument or
        // subcommand, an unknown flag): clap's own words, with the usage.
        Err(err) => err.exit(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Serve(args) => match run_serve(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(reason) => {
                eprintln!("presenced: {reason}");
                ExitCode::from(2)
            }
        },
        Command::Token(command) => match run_token(command) {
            Ok(()) => ExitCode::SUCCESS,
            Err(reason) => {
                eprintln!("presenced: {reason}");
                ExitCode::from(2)
            }
        },
        Command::DevCerts(args) => match run_dev_certs(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(reason) => {
                eprintln!("presenced dev-certs: {reason}");
                ExitCode::from(2)
            }
        },
        Command::Client(command) => presence_cli::run(command),
    }
}

fn run_serve(args: ServeArgs) -> Result<(), String> {
    let settings = args.resolve().map_err(|err| err.to_string())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.worker_threads)
        .enable_all()
        .build()
        .map_err(|err| format!("cannot start the runtime: {err}"))?;
    runtime.block_on(async {
        // The exporter binds its address here, before anything is announced.
        // It goes before `prepare`, which makes the server's metric handles:
        // handles made before a recorder is installed record nowhere.
        let metrics = match settings.metrics_listen {
            Some(addr) => Some(install_metrics_recorder(addr).await?),
            None => None,
        };
        // Every check of the configuration that the library makes (credentials,
        // key and certificate files, the data directory) happens before the
        // listener is bound and the listening line printed (B7).
        let prepared = presence_server::PreparedServer::prepare(settings.server).map_err(refusal)?;
        // Said once the start is sure: a refused start says only why (B7).
        for warning in &settings.warnings {
            tracing::warn!("{warning}");
        }
        if let Some((listener, render)) = metrics {
            let addr = listener.local_addr().ok();
            prepared.spawn_metrics_endpoint(listener, render);
            tracing::info!(?addr, "serving metrics");
        }
        let listeners = bind(settings.listen).await?;
        let local = listeners[0].local_addr().map_err(|err| format!("cannot read the bound address: {err}"))?;
        // The first line of stdout, for scripts and tests that asked for port 0.
        let shutdown = shutdown_signal()?;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on {local}").and_then(|()| stdout.flush()).ok();
        drop(stdout);
        prepared.serve_on(listeners, shutdown).await.map_err(refusal)
    })
}

/// The listeners of `listen`: one, or for `localhost:PORT` one on each
/// loopback, the second on the port the first got (port 0 picks it). A
/// machine without IPv6 serves on 127.0.0.1 alone, and says so.
async fn bind(listen: config::ListenAddr) -> Result<Vec<TcpListener>, String> {
    let cannot = |addr: &dyn std::fmt::Display, err: std::io::Error| format!("cannot listen on {addr}: {err}");
    let first = match listen {
        config::ListenAddr::Socket(addr) => {
            return Ok(vec![TcpListener::bind(addr).await.map_err(|err| cannot(&addr, err))?]);
        }
        config::ListenAddr::Localhost(port) => (std::net::Ipv4Addr::LOCALHOST, port),
    };
    let v4 = TcpListener::bind(first).await.map_err(|err| cannot(&listen, err))?;
    let port = v4.local_addr().map_err(|err| format!("cannot read the bound address: {err}"))?.port();
    match TcpListener::bind((std::net::Ipv6Addr::LOCALHOST, port)).await {
        Ok(v6) => Ok(vec![v4, v6]),
        Err(err) if err.kind() == std::io::ErrorKind::AddrNotAvailable => {
            tracing::warn!("--listen {listen}: ::1 is not available here ({err}); serving on 127.0.0.1 alone");
            Ok(vec![v4])
        }
        Err(err) => Err(cannot(&format!("[::1]:{port} (--listen {listen})"), err)),
    }
}

/// A command-line error of clap's in the one line every refusal takes:
/// clap's own rendering spreads it over a usage block and a hint.
fn one_line(err: &clap::Error) -> String {
    let rendered = err.render().to_string();
    let parts: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("Usage:") && !line.starts_with("For more information"))
        .map(|line| line.strip_prefix("error: ").unwrap_or(line))
        .collect();
    parts.join("; ")
}

/// The one line a refusal prints, naming the flag behind it where the
/// library's error says only what it is about.
fn refusal(err: presence_server::ServeError) -> String {
    use presence_server::{AuthConfigError, ServeError};
    let flag = match &err {
        ServeError::Auth(AuthConfigError::ServiceToken { .. }) => "--service-token",
        ServeError::Auth(AuthConfigError::Hs256SecretTooShort { .. }) => "--viewer-jwt-hs256-secret",
        ServeError::Auth(AuthConfigError::PublicKey { .. }) => "--viewer-jwt-public-key",
        ServeError::Auth(AuthConfigError::Leeway { .. }) => "--jwt-leeway-secs",
        ServeError::DataDir { .. } => "--data-dir",
        ServeError::CorsOrigin { .. } => "--cors-origin",
        _ => return err.to_string(),
    };
    format!("invalid {flag}: {err}")
}

/// Makes the server's metrics go to a Prometheus recorder and binds the
/// metrics port at `addr`; the library serves it (over TLS when the service
/// port has TLS) once the configuration is checked.
async fn install_metrics_recorder(
    addr: std::net::SocketAddr,
) -> Result<(TcpListener, presence_server::RenderMetrics), String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    use presence_server::metrics::{LATENCY_BUCKETS, MOVE_BUCKETS, names};
    let cannot = |err: &dyn std::fmt::Display| format!("cannot serve metrics on {addr}: {err}");
    let listener = TcpListener::bind(addr).await.map_err(|err| cannot(&err))?;
    let mut builder = PrometheusBuilder::new();
    for histogram in
        [names::RENEWAL_SECONDS, names::EXPIRY_LAG_SECONDS, names::FOLLOWER_LAG_SECONDS, names::FEED_WRITE_SECONDS]
    {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(histogram.to_owned()), LATENCY_BUCKETS)
            .map_err(|err| cannot(&err))?;
    }
    for histogram in [names::MOVE_FREEZE_SECONDS, names::REQUEST_HOLD_SECONDS] {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(histogram.to_owned()), MOVE_BUCKETS)
            .map_err(|err| cannot(&err))?;
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|err| cannot(&err))?;
    // What the exporter's own listener would do: drain histogram samples now and then.
    tokio::spawn({
        let handle = handle.clone();
        async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        }
    });
    Ok((listener, std::sync::Arc::new(move || handle.render())))
}

/// Listens for SIGINT and SIGTERM from now on (so that a signal sent as soon
/// as the listening line is printed is not lost to the default action) and
/// returns a future that completes on the first of them.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, String> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let listen =
            |kind: SignalKind, name: &str| signal(kind).map_err(|err| format!("cannot listen for {name}: {err}"));
        let mut interrupt = listen(SignalKind::interrupt(), "SIGINT")?;
        let mut terminate = listen(SignalKind::terminate(), "SIGTERM")?;
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => tracing::info!("SIGINT received"),
                _ = terminate.recv() => tracing::info!("SIGTERM received"),
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
