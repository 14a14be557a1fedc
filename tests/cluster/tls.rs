//! T1, T2 in a cluster: three nodes and etcd, every connection over mutual
//! TLS (gateways to nodes, node to node, nodes to etcd), route a gateway's
//! batch to every owner, hand a slot over, and take over a node killed
//! with `kill -9`; a caller with a valid service token but no certificate
//! of the cluster's CA cannot call the `Cluster` service.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::common::daemon::{Daemon, scratch_dir};
use crate::common::tls::{Issued, Pki, client_tls};
use presence_cluster::testing::EtcdServerTls;
use presence_proto::v1::cluster_client::ClusterClient;
use presence_tls::{ClientTls, ClientTlsFiles};

const TOKEN: &str = "a-cluster-service-token";
const GATEWAY_IDENTITY: &str = "spiffe://test.example/gateway";

/// The certificates of a cluster whose every connection is mutual TLS: the
/// service certificates clients see (from one CA), the certificates nodes
/// show each other and etcd (from the cluster's CA), gateways' client
/// certificates (from a third), etcd's own (from a fourth).
struct Certificates {
    dir: PathBuf,
    service: Pki,
    cluster: Pki,
    clients: Pki,
    etcd: Pki,
    gateway: Issued,
}

impl Certificates {
    fn new() -> Certificates {
        let dir = scratch_dir("cluster-tls");
        let (service, cluster, clients, etcd) =
            (Pki::new(&dir, "service"), Pki::new(&dir, "cluster"), Pki::new(&dir, "clients"), Pki::new(&dir, "etcd"));
        let gateway = clients.issue("gateway", &["gateway.test.example", GATEWAY_IDENTITY]);
        Certificates { dir, service, cluster, clients, etcd, gateway }
    }

    /// `presenced serve` flags for `node`: its service and peer certificates, mutual TLS, etcd's TLS.
    fn node_flags(&self, node: &str) -> Vec<String> {
        let service = self.service.issue(&format!("{node}-service"), &["127.0.0.1", "localhost"]);
        let peer = self.cluster.issue(node, &["127.0.0.1", &format!("{node}.cluster")]);
        let path = |path: &Path| path.display().to_string();
        [
            ("--tls-cert", path(&service.cert)),
            ("--tls-key", path(&service.key)),
            ("--tls-client-ca", path(&self.clients.ca_path())),
            ("--tls-service-identity", GATEWAY_IDENTITY.to_owned()),
            ("--peer-tls-cert", path(&peer.cert)),
            ("--peer-tls-key", path(&peer.key)),
            ("--peer-tls-ca", path(&self.cluster.ca_path())),
            ("--etcd-ca", path(&self.etcd.ca_path())),
            ("--etcd-cert", path(&peer.cert)),
            ("--etcd-key", path(&peer.key)),
            ("--service-token", TOKEN.to_owned()),
            ("--default-visibility", "everyone".to_owned()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect()
    }

    async fn etcd(&self) -> EtcdServer {
        let server = self.etcd.issue("etcd", &["127.0.0.1", "localhost"]);
        let harness = self.cluster.issue("harness", &["harness.cluster"]);
        let files = ClientTlsFiles::new(Some(self.etcd.ca_path()), Some(harness.cert), Some(harness.key));
        EtcdServer::start_with_tls(EtcdServerTls {
            cert: server.cert,
            key: server.key,
            client_ca: self.cluster.ca_path(),
            client: Arc::new(ClientTls::load(files).unwrap()),
        })
        .await
    }
}

async fn gateway_client(certificates: &Certificates, node: &Daemon) -> PresenceClient<Channel> {
    let tls = client_tls(&certificates.service.ca_path(), Some(&certificates.gateway));
    PresenceClient::new(presence_client::connect(&format!("https://{}", node.addr()), Some(&tls)).await.unwrap())
}

async fn cluster_client(node: &Daemon, ca: &Path, cert: Option<&Issued>) -> ClusterClient<Channel> {
    let tls = client_tls(ca, cert);
    ClusterClient::new(presence_client::connect(&format!("https://{}", node.addr()), Some(&tls)).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t2_three_nodes_and_etcd_over_mutual_tls_route_move_and_take_over_and_refuse_a_token_alone() {
    let certificates = Certificates::new();
    let etcd = certificates.etcd().await;
    assert!(etcd.endpoint.starts_with("https://"), "{}", etcd.endpoint);
    let mut nodes = Vec::new();
    for node in NODES {
        let advertise = format!("127.0.0.1:{}", daemon::free_port());
        let mut args = node_process_args(&etcd, node, &advertise);
        args.extend(certificates.node_flags(node));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        nodes.push(Daemon::start_on(&advertise, &args, &[], Some(&certificates.dir.join(format!("{node}.log")))));
    }
    let etcd_client = etcd.client().await;
    let map =
        map_where(&etcd_client, "every node owns slots", |map| NODES.iter().all(|node| map.owned_by(node).count() > 0))
            .await;

    // Routing: a gateway (a service by its certificate alone) sends one
    // batch to node-b; each item reaches its owner over node-to-node TLS.
    let users: Vec<String> = (0..300).map(|i| format!("tls-user-{i}")).collect();
    let config = LeaseChannelConfig {
        tls: Some(client_tls(&certificates.service.ca_path(), Some(&certificates.gateway))),
        ..LeaseChannelConfig::default()
    };
    let leases = ClusterLeases::new(&format!("https://{}", nodes[1].addr()), SLOTS, config).unwrap();
    let registered = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
    let generations: Vec<u64> = registered
        .into_iter()
        .map(|result| match lease_result(result) {
            Ok(pb::lease_result::Result::Register(done)) => done.generation,
            other => panic!("{other:?}"),
        })
        .collect();
    let owners: std::collections::HashSet<String> =
        users.iter().map(|user| map.owner(slot_of(user, SLOTS)).unwrap().node.clone()).collect();
    assert_eq!(owners.len(), 3, "the users are spread over every node");
    let mut at_c = gateway_client(&certificates, &nodes[2]).await;
    let before = presences(&mut at_c, &users).await;
    assert!(before.values().all(|presence| presence.state == pb::State::Online as i32), "any node answers for all");

    // A token alone does not make a node: the gateway's certificate with
    // the service token cannot call the Cluster service, and neither can a
    // node's certificate from another CA.
    let mut as_gateway = cluster_client(&nodes[0], &certificates.service.ca_path(), Some(&certificates.gateway)).await;
    let slot = map.owned_by("node-a").next().unwrap();
    let move_request = || pb::MoveSlotsRequest { slots: vec![slot], to_node: "node-b".into(), ..Default::default() };
    let refused = as_gateway
        .move_slots(crate::common::with_token(move_request(), Some(TOKEN)))
        .await
        .expect_err("a service token without a node's certificate");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("certificate of the cluster's CA"), "{refused:?}");
    // And not the calls nodes make of each other either.
    let scan = as_gateway
        .room_scan(crate::common::with_token(pb::RoomScanRequest::default(), Some(TOKEN)))
        .await
        .expect_err("RoomScan with a service token alone");
    assert_eq!(scan.code(), Code::PermissionDenied, "{scan:?}");

    // A planned move, asked by an operator holding a node's certificate: the
    // slot's users go to node-b over node-to-node TLS, nobody flips.
    let operator = certificates.cluster.issue("operator", &["operator.cluster"]);
    let mut as_operator = cluster_client(&nodes[0], &certificates.service.ca_path(), Some(&operator)).await;
    as_operator.move_slots(crate::common::with_token(move_request(), Some(TOKEN))).await.expect("the move");
    map_where(&etcd_client, "the slot at node-b", |map| map.owner(slot).unwrap().node == "node-b").await;
    assert_online_at_the_versions_before(&mut at_c, &users, &before).await;

    // kill -9 of node-a: its followers take its slots over from their copies, streamed over TLS.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    nodes.remove(0).kill9();
    map_where(&etcd_client, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
    assert_online_at_the_versions_before(&mut at_c, &users, &before).await;
    let renewals: Vec<pb::LeaseItem> = users
        .iter()
        .zip(&generations)
        .map(|(user, generation)| pb::LeaseItem {
            op: Some(pb::lease_item::Op::Renew(pb::RenewRequest {
                user_id: user.clone(),
                session_id: "s".into(),
                generation: *generation,
                ttl_ms: 30_000,
                ..Default::default()
            })),
        })
        .collect();
    let renewed = presence_server::testing::within(PATIENCE, "renewals at the new owners", async {
        loop {
            let answers = leases.submit_batch(renewals.clone()).await;
            if answers.iter().all(|answer| answer.code == 0) {
                return answers.len();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(renewed, users.len());
    for node in nodes {
        node.stop().await;
    }
}
