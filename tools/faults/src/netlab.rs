//! A network namespace for the server, reached from the host over a veth
//! pair, with nftables drop rules per client group.
//!
//! Layout of lab `N` (N is picked free at creation, 0..=255):
//!
//! ```text
//!  host (clients)                          namespace pfaults-N (server)
//!  pfNh: 10.77.N.1  group 0   <-- veth -->  pfNs: 10.77.N.2
//!        10.77.N.3  group 1
//!        10.77.N.5  group 2 ...
//! ```
//!
//! Each client group is one source address on the host, so a fault can hit
//! one group (the gateways, the viewers, half the gateways) and spare the
//! rest. The rules live in one nftables table inside the namespace, matching
//! the group's address as source on the way in and as destination on the way
//! out, so a fault always covers both directions and dies with the namespace.
//!
//! The number `N` is reserved by creating the namespace (the kernel refuses a
//! second one of the same name), and the owning pid is written beside it, so a
//! lab left behind by a killed test process is reclaimed by the next one.

use std::fmt::Write as _;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd as _;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use crate::{FaultError, Result, io_err, require_programs, require_root, run};

/// Where the owner pid of each lab number is written.
const OWNER_DIR: &str = "/run/presence-faults";

/// The nftables table holding a lab's rules (inside its namespace).
const TABLE: &str = "presence_faults";

/// Most client groups a lab can have: host addresses are the odd numbers
/// 1..=253 of the /24.
const MAX_GROUPS: usize = 127;

/// What is currently done to one client group's traffic.
#[derive(Debug, Clone, Copy, Default)]
struct GroupFault {
    /// Probability in [0, 1] that a packet is dropped, each direction.
    loss: f64,
    /// Every packet is dropped, both directions.
    partitioned: bool,
}

/// A network namespace holding the server side of a veth pair; the host side
/// has one address per client group. Faults are set per group and removed
/// with the namespace when the lab is dropped.
#[derive(Debug)]
pub struct NetLab {
    /// The lab number N: the third octet of every address.
    net: u8,
    /// Namespace name, `pfaults-N`.
    name: String,
    /// Host end of the veth pair.
    host_if: String,
    /// Number of client groups (host addresses).
    groups: usize,
    /// The faults now applied, rewritten as one nftables table on each change.
    faults: Mutex<Vec<GroupFault>>,
}

impl NetLab {
    /// Creates a lab with `groups` client groups (1..=127). Needs root, `ip`
    /// (iproute2) and `nft` (nftables).
    pub fn new(groups: usize) -> Result<NetLab> {
        assert!((1..=MAX_GROUPS).contains(&groups), "a lab has 1..={MAX_GROUPS} client groups, not {groups}");
        require_root("NetLab (network namespaces)")?;
        require_programs(&["ip", "nft"], "install-fault-tools")?;
        std::fs::create_dir_all(OWNER_DIR).map_err(io_err(format!("creating {OWNER_DIR}")))?;

        let start = (std::process::id() % 256) as u8;
        for step in 0..=255u8 {
            let net = start.wrapping_add(step);
            if reserve(net)? {
                let lab = NetLab {
                    net,
                    name: namespace_name(net),
                    host_if: format!("pf{net}h"),
                    groups,
                    faults: Mutex::new(vec![GroupFault::default(); groups]),
                };
                // From here on, Drop removes whatever was made.
                lab.wire()?;
                return Ok(lab);
            }
        }
        Err(FaultError::Io {
            what: "reserving a lab number".into(),
            source: std::io::Error::other("all 256 lab numbers are in use by live processes"),
        })
    }

    /// The namespace's name, for `ip netns exec`.
    pub fn namespace(&self) -> &str {
        &self.name
    }

    /// The server's address, inside the namespace.
    pub fn server_ip(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 77, self.net, 2))
    }

    /// The host address of client group `group` (0-based): 10.77.N.1, .3, .5 …
    pub fn group_ip(&self, group: usize) -> IpAddr {
        assert!(group < self.groups, "group {group} of a lab with {} groups", self.groups);
        IpAddr::V4(Ipv4Addr::new(10, 77, self.net, (2 * group + 1) as u8))
    }

    /// The number of client groups.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }

    /// Runs `f` on a thread that has entered the namespace, and returns its
    /// result. A socket keeps the namespace it was made in, so a listener
    /// bound here can be served from any thread afterwards.
    pub fn run_in<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        let path = PathBuf::from("/run/netns").join(&self.name);
        std::thread::spawn(move || -> Result<T> {
            let file = File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
            // SAFETY: the fd is valid for the call; setns changes only this
            // thread's network namespace, and the thread ends after `f`.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io_err("setns into the lab")(std::io::Error::last_os_error()));
            }
            Ok(f())
        })
        .join()
        .expect("the closure run in the namespace panicked")
    }

    /// A gRPC endpoint to the server at `port` whose connections leave from
    /// `group`'s address (tonic binds the socket to it before connecting).
    pub fn endpoint(&self, group: usize, port: u16) -> tonic::transport::Endpoint {
        let uri = format!("http://{}:{port}", self.server_ip());
        tonic::transport::Endpoint::from_shared(uri)
            .expect("an http URI of an IPv4 address and a port is valid")
            .local_address(Some(self.group_ip(group)))
    }

    /// Drops each packet between `group` and the server with `probability`
    /// (0 stops the loss), in each direction independently.
    pub fn loss(&self, group: usize, probability: f64) -> Result<()> {
        assert!((0.0..=1.0).contains(&probability), "loss probability {probability} is not in [0, 1]");
        self.change(group, |fault| fault.loss = probability)
    }

    /// Drops every packet between `group` and the server, both directions:
    /// a connect times out and an established connection stalls.
    pub fn partition(&self, group: usize) -> Result<()> {
        self.change(group, |fault| fault.partitioned = true)
    }

    /// Ends a partition of `group` (its loss, if any, stays).
    pub fn heal(&self, group: usize) -> Result<()> {
        self.change(group, |fault| fault.partitioned = false)
    }

    /// Removes every fault of every group.
    pub fn heal_all(&self) -> Result<()> {
        let mut faults = self.faults.lock().expect("fault table lock");
        faults.fill(GroupFault::default());
        self.apply(&faults)
    }

    /// Changes one group's fault and rewrites the rules.
    fn change(&self, group: usize, edit: impl FnOnce(&mut GroupFault)) -> Result<()> {
        let _ = self.group_ip(group); // bounds check with a clear message
        let mut faults = self.faults.lock().expect("fault table lock");
        edit(&mut faults[group]);
        self.apply(&faults)
    }

    /// Replaces the lab's nftables table in one transaction, so there is no
    /// moment where an old rule is gone and the new one not yet in place.
    fn apply(&self, faults: &[GroupFault]) -> Result<()> {
        let mut input = String::new();
        let mut output = String::new();
        for (group, fault) in faults.iter().enumerate() {
            let ip = self.group_ip(group);
            if fault.partitioned {
                writeln!(input, "    ip saddr {ip} drop").expect("write to String");
                writeln!(output, "    ip daddr {ip} drop").expect("write to String");
            } else if fault.loss > 0.0 {
                // numgen draws uniformly in [0, 1e6): drop below loss * 1e6.
                let below = (fault.loss * 1e6).round() as u64;
                let rule = format!("numgen random mod 1000000 < {below} drop");
                writeln!(input, "    ip saddr {ip} {rule}").expect("write to String");
                writeln!(output, "    ip daddr {ip} {rule}").expect("write to String");
            }
        }
        let script = format!(
            "table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n  \
             chain input {{\n    type filter hook input priority 0; policy accept;\n{input}  }}\n  \
             chain output {{\n    type filter hook output priority 0; policy accept;\n{output}  }}\n}}\n"
        );
        run(self.command("nft").args(["-f", "-"]), Some(&script))
    }

    /// Makes the veth pair, the addresses and the empty rule table.
    fn wire(&self) -> Result<()> {
        let ns_if = format!("pf{}s", self.net);
        let host_if = self.host_if.as_str();
        let ip = |args: &[&str]| run(Command::new("ip").args(args), None);
        ip(&["link", "add", host_if, "type", "veth", "peer", "name", &ns_if, "netns", &self.name])?;
        for group in 0..self.groups {
            ip(&["addr", "add", &format!("{}/24", self.group_ip(group)), "dev", host_if])?;
        }
        ip(&["link", "set", host_if, "up"])?;
        let server = format!("{}/24", self.server_ip());
        ip(&["-n", &self.name, "addr", "add", &server, "dev", &ns_if])?;
        ip(&["-n", &self.name, "link", "set", &ns_if, "up"])?;
        ip(&["-n", &self.name, "link", "set", "lo", "up"])?;
        self.apply(&self.faults.lock().expect("fault table lock"))
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, which deletes the host
        // end, and the rule table inside it. Errors are ignored: Drop may run
        // while a half-made lab unwinds.
        let _ = run(Command::new("ip").args(["netns", "del", &self.name]), None);
        let _ = run(Command::new("ip").args(["link", "del", &self.host_if]), None);
        let _ = std::fs::remove_file(owner_file(self.net));
    }
}

/// Connects to `remote` from the local address `local` (port chosen by the
/// kernel): how a client of one group reaches the server over its address.
/// For tonic, [`NetLab::endpoint`] does the same with `Endpoint::local_address`.
pub async fn connect_from(local: IpAddr, remote: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = match local {
        IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(local, 0))?;
    socket.connect(remote).await
}

fn namespace_name(net: u8) -> String {
    format!("pfaults-{net}")
}

fn owner_file(net: u8) -> PathBuf {
    PathBuf::from(OWNER_DIR).join(format!("{net}.pid"))
}

/// Tries to take lab number `net`: true when this process now owns it.
/// A number held by a process that is gone is reclaimed.
fn reserve(net: u8) -> Result<bool> {
    let name = namespace_name(net);
    let add = || run(Command::new("ip").args(["netns", "add", &name]), None).is_ok();
    if !add() {
        let owner =
            std::fs::read_to_string(owner_file(net)).ok().and_then(|text| text.trim().parse::<libc::pid_t>().ok());
        // Without an owner file the lab may be being made right now; leave it.
        let Some(pid) = owner else { return Ok(false) };
        // SAFETY: signal 0 only checks whether the process exists.
        let alive =
            unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if alive {
            return Ok(false);
        }
        let _ = run(Command::new("ip").args(["netns", "del", &name]), None);
        let _ = run(Command::new("ip").args(["link", "del", &format!("pf{net}h")]), None);
        if !add() {
            return Ok(false);
        }
    }
    std::fs::write(owner_file(net), std::process::id().to_string()).map_err(io_err("writing the lab's owner file"))?;
    Ok(true)
}
