//! The parts of etcd's v3 API that cluster mode uses.

use std::time::Duration;

use std::sync::Arc;

use presence_tls::{ClientTls, TlsEndpoint};
use tonic::transport::Channel;

/// etcd's v3 API as generated from this crate's `proto/` (clients only).
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic, rust_2018_idioms)]
pub mod api {
    /// Keys, values and events.
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    /// Users and roles (imported by the RPC definitions).
    pub mod authpb {
        tonic::include_proto!("authpb");
    }
    /// KV, Watch and Lease.
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    /// The election service (campaign, observe, resign).
    pub mod v3electionpb {
        tonic::include_proto!("v3electionpb");
    }
}

use api::etcdserverpb::{kv_client::KvClient, lease_client::LeaseClient, watch_client::WatchClient};
use api::v3electionpb::election_client::ElectionClient;

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The endpoint is not a URL this can connect to.
    #[error("etcd endpoint {endpoint}: {source}")]
    Endpoint {
        /// As given.
        endpoint: String,
        /// Why it was refused.
        source: presence_tls::TlsError,
    },
    /// etcd could not be reached within the connect timeout.
    #[error("etcd at {endpoint} could not be reached: {source}")]
    Unreachable {
        /// As given.
        endpoint: String,
        /// The connection's error.
        source: tonic::transport::Error,
    },
    /// etcd answered an RPC with an error.
    #[error("etcd refused {rpc}: {status}")]
    Refused {
        /// The RPC.
        rpc: &'static str,
        /// Its answer.
        status: tonic::Status,
    },
    /// No etcd endpoint was given.
    #[error("no etcd endpoint given")]
    NoEndpoint,
    /// A stream etcd was sending on ended.
    #[error("etcd ended the {0} stream")]
    StreamEnded(&'static str),
}

impl Error {
    pub(crate) fn refused(rpc: &'static str) -> impl FnOnce(tonic::Status) -> Error {
        move |status| Error::Refused { rpc, status }
    }
}

/// Clients of one etcd endpoint, sharing one HTTP/2 connection; cheap to clone.
#[derive(Debug, Clone)]
pub struct Etcd {
    pub(crate) kv: KvClient<Channel>,
    pub(crate) lease: LeaseClient<Channel>,
    pub(crate) watch: WatchClient<Channel>,
    pub(crate) election: ElectionClient<Channel>,
}

/// How long connecting to etcd may take before [`Etcd::connect`] gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl Etcd {
    /// Connects to `endpoint` (`http://127.0.0.1:2379`, or `https://` with
    /// `tls`: etcd's CA and, for its `--client-cert-auth`, a client
    /// certificate). Once connected, a lost connection is reconnected by
    /// tonic on the next call, with the TLS material current then (T4).
    pub async fn connect(endpoint: &str, tls: Option<&Arc<ClientTls>>) -> Result<Etcd, Error> {
        let address = TlsEndpoint::new(endpoint, tls.cloned(), None)
            .map_err(|source| Error::Endpoint { endpoint: endpoint.to_owned(), source })?;
        let channel = address
            .endpoint()
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(3))
            .connect_with_connector(address.connector())
            .await
            .map_err(|source| Error::Unreachable { endpoint: endpoint.to_owned(), source })?;
        Ok(Etcd {
            kv: KvClient::new(channel.clone()),
            lease: LeaseClient::new(channel.clone()),
            watch: WatchClient::new(channel.clone()),
            election: ElectionClient::new(channel),
        })
    }
}

impl Etcd {
    /// Connects to the first of `endpoints` (an etcd cluster's members) that
    /// answers; the last one's error when none does.
    pub async fn connect_any(endpoints: &[String], tls: Option<&Arc<ClientTls>>) -> Result<Etcd, Error> {
        let mut last = Error::NoEndpoint;
        for endpoint in endpoints {
            match Etcd::connect(endpoint, tls).await {
                Ok(etcd) => return Ok(etcd),
                Err(error) => {
                    tracing::warn!(endpoint, %error, "etcd endpoint unreachable; trying the next");
                    last = error;
                }
            }
        }
        Err(last)
    }

    /// One key's current value and revisions, if it exists.
    pub async fn get(&self, key: &[u8]) -> Result<Option<api::mvccpb::KeyValue>, Error> {
        let range = api::etcdserverpb::RangeRequest { key: key.to_vec(), ..Default::default() };
        let answer = self.kv.clone().range(range).await.map_err(Error::refused("Range"))?.into_inner();
        Ok(answer.kvs.into_iter().next())
    }

    /// Whether etcd answers a linearizable read within `wait`: it has a
    /// leader that a quorum follows, so it could expire leases and change
    /// keys now. (A serializable read would be answered by a lone member.)
    pub async fn answers_within(&self, wait: Duration) -> bool {
        let range = api::etcdserverpb::RangeRequest {
            key: b"presenced-probe".to_vec(),
            count_only: true,
            ..Default::default()
        };
        matches!(tokio::time::timeout(wait, self.kv.clone().range(range)).await, Ok(Ok(_)))
    }

    /// The raft term of the etcd member answering: it changes when etcd
    /// elects a new leader, which renews every lease in full (so a lease
    /// may then outlive its node's last keep-alive by more than its TTL).
    pub async fn raft_term(&self) -> Result<u64, Error> {
        let range = api::etcdserverpb::RangeRequest {
            key: b"presenced-probe".to_vec(),
            count_only: true,
            ..Default::default()
        };
        let answer = self.kv.clone().range(range).await.map_err(Error::refused("Range"))?.into_inner();
        Ok(answer.header.map_or(0, |header| header.raft_term))
    }

    /// The value the leader of election `name` campaigned with (a node id),
    /// if the election has a leader.
    pub async fn leader(&self, name: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        let request = api::v3electionpb::LeaderRequest { name: name.to_vec() };
        match self.election.clone().leader(request).await {
            Ok(answer) => Ok(answer.into_inner().kv.map(|kv| kv.value)),
            // etcd answers "election: no leader" as an error.
            Err(status) if status.message().contains("no leader") => Ok(None),
            Err(status) => Err(Error::Refused { rpc: "Leader", status }),
        }
    }

    /// Deletes one key; whether it existed.
    pub async fn delete(&self, key: &[u8]) -> Result<bool, Error> {
        let delete = api::etcdserverpb::DeleteRangeRequest { key: key.to_vec(), ..Default::default() };
        let answer = self.kv.clone().delete_range(delete).await.map_err(Error::refused("DeleteRange"))?.into_inner();
        Ok(answer.deleted > 0)
    }
}

/// The end of the key range that holds every key starting with `prefix`:
/// etcd's convention, the prefix with its last byte increased.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xff: to the end of the keyspace.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_at_the_prefix_with_its_last_byte_raised() {
        assert_eq!(prefix_end(b"/presenced/slots/"), b"/presenced/slots0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
