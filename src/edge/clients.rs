//! `[clients]`: the credentials allowed to use the gateway at all, as SHA-256 digests (never
//! raw secrets). The allow file is re-read on SIGHUP; a file that cannot be read then keeps
//! the list that was in force, and says why.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use tracing::{info, warn};

use crate::config::{read_allow_file, ClientsConfig};

#[derive(Debug)]
pub struct Clients {
    inline: HashSet<String>,
    file: Option<PathBuf>,
    allowed: RwLock<Arc<HashSet<String>>>,
}

impl Clients {
    pub fn new(config: &ClientsConfig) -> Arc<Self> {
        let clients = Arc::new(Self {
            inline: config.allow.clone(),
            file: config.allow_file.clone(),
            allowed: RwLock::new(Arc::new(config.allow.clone())),
        });
        clients.reload();
        clients
    }

    /// Whether the owner digest of a request is allowed.
    pub fn allows(&self, digest: &str) -> bool {
        self.allowed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(digest)
    }

    /// Re-reads the allow file; the inline `allow` list always stays.
    pub fn reload(&self) {
        let Some(file) = &self.file else { return };
        match read_allow_file(file) {
            Ok(from_file) => {
                let mut allowed = self.inline.clone();
                allowed.extend(from_file);
                info!(clients = allowed.len(), file = %file.display(), "client allow list loaded");
                *self.allowed.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(allowed);
            }
            Err(e) => warn!(error = %e, "client allow list not reloaded; the previous one stays"),
        }
    }

    /// Reloads on every SIGHUP until the process ends.
    #[cfg(unix)]
    pub fn reload_on_sighup(self: &Arc<Self>) {
        if self.file.is_none() {
            return;
        }
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            warn!("cannot listen for SIGHUP: the client allow file is read once");
            return;
        };
        let clients = Arc::downgrade(self);
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                let Some(clients) = clients.upgrade() else {
                    return;
                };
                clients.reload();
            }
        });
    }
}
