use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use hearth_api::{FileInfo, FileList, MkdirRequest, RenameRequest};
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, Url};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::io::ReaderStream;

use crate::client::decode_json;
use crate::{Client, Error};

impl Client {
    /// Uploads everything `reader` yields to `path` in the guest (created or replaced; the parent directory
    /// must exist), streamed. Returns the written file's metadata.
    pub async fn upload<R>(&self, id: &str, path: &str, reader: R) -> Result<FileInfo, Error>
    where
        R: AsyncRead + Send + 'static,
    {
        self.upload_stream(id, path, ReaderStream::new(reader)).await
    }

    /// Uploads a stream of chunks to `path` in the guest, streamed.
    pub async fn upload_stream<S, E>(&self, id: &str, path: &str, chunks: S) -> Result<FileInfo, Error>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
    {
        self.put_file(id, path, reqwest::Body::wrap_stream(chunks)).await
    }

    /// Writes `data` to `path` in the guest.
    pub async fn write_file(&self, id: &str, path: &str, data: impl Into<Bytes>) -> Result<FileInfo, Error> {
        self.put_file(id, path, reqwest::Body::from(data.into())).await
    }

    async fn put_file(&self, id: &str, path: &str, body: reqwest::Body) -> Result<FileInfo, Error> {
        let url = self.file_url(id, &[], path);
        let builder = self
            .request(Method::PUT, &url)
            .header(CONTENT_TYPE, "application/octet-stream")
            .body(body);
        let resp = self.send(builder, &url).await?;
        decode_json(resp, &url).await
    }

    /// Opens `path` in the guest for reading. The daemon's answer (and so a `not_found`) arrives before this
    /// returns; the bytes then arrive as the stream is polled.
    pub async fn download_stream(
        &self,
        id: &str,
        path: &str,
    ) -> Result<impl Stream<Item = Result<Bytes, Error>> + Send + 'static + use<>, Error> {
        let url = self.file_url(id, &[], path);
        let resp = self.send(self.request(Method::GET, &url), &url).await?;
        Ok(resp.bytes_stream().map_err(move |e| Error::transport(&url, e)))
    }

    /// Copies `path` from the guest into `writer`, streamed; returns the number of bytes written. The writer
    /// is flushed but not shut down.
    pub async fn download<W>(&self, id: &str, path: &str, writer: &mut W) -> Result<u64, Error>
    where
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut body = std::pin::pin!(self.download_stream(id, path).await?);
        let mut total = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            writer.write_all(&chunk).await?;
            total += chunk.len() as u64;
        }
        writer.flush().await?;
        Ok(total)
    }

    /// Reads a whole file from the guest into memory. Prefer [`Client::download`] for large files.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<Vec<u8>, Error> {
        let mut out = Vec::new();
        self.download(id, path, &mut out).await?;
        Ok(out)
    }

    /// Deletes a file, or a directory (which must be empty unless `recursive`).
    pub async fn delete_file(&self, id: &str, path: &str, recursive: bool) -> Result<(), Error> {
        let mut url = self.file_url(id, &[], path);
        if recursive {
            url.query_pairs_mut().append_pair("recursive", "true");
        }
        self.call_no_content::<()>(Method::DELETE, url, None).await
    }

    /// Metadata of one path (symlinks are not followed).
    pub async fn stat(&self, id: &str, path: &str) -> Result<FileInfo, Error> {
        self.call::<(), _>(Method::GET, self.file_url(id, &["stat"], path), None)
            .await
    }

    /// Entries of a directory.
    pub async fn list_dir(&self, id: &str, path: &str) -> Result<FileList, Error> {
        self.call::<(), _>(Method::GET, self.file_url(id, &["list"], path), None)
            .await
    }

    /// Creates a directory (and its missing parents when `parents`).
    pub async fn mkdir(&self, id: &str, path: &str, parents: bool) -> Result<(), Error> {
        let url = self.url(&["v1", "sandboxes", id, "files", "mkdir"]);
        let req = MkdirRequest {
            path: path.to_owned(),
            parents,
        };
        self.call_no_content(Method::POST, url, Some(&req)).await
    }

    /// Renames (moves) `from` to `to` inside the guest.
    pub async fn rename(&self, id: &str, from: &str, to: &str) -> Result<(), Error> {
        let url = self.url(&["v1", "sandboxes", id, "files", "rename"]);
        let req = RenameRequest {
            from: from.to_owned(),
            to: to.to_owned(),
        };
        self.call_no_content(Method::POST, url, Some(&req)).await
    }

    fn file_url(&self, id: &str, extra: &[&str], path: &str) -> Url {
        let mut segments = vec!["v1", "sandboxes", id, "files"];
        segments.extend_from_slice(extra);
        let mut url = self.url(&segments);
        url.query_pairs_mut().append_pair("path", path);
        url
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::Client;

    #[test]
    fn file_paths_go_in_the_query_encoded() {
        let c = Client::new("http://127.0.0.1:7070", "k").unwrap();
        assert_eq!(
            c.file_url("sbx_0123456789abcdef", &["stat"], "/a b&c=d").as_str(),
            "http://127.0.0.1:7070/v1/sandboxes/sbx_0123456789abcdef/files/stat?path=%2Fa+b%26c%3Dd"
        );
    }
}
