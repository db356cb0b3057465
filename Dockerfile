# Multi-stage build: compile in the Rust image, run from a small distroless image as a
# non-root user. The config is mounted at /etc/idemgate/idemgate.toml.
#
#   docker build -t idemgate .
#   docker run -p 8080:8080 -p 8081:8081 \
#     -v $PWD/config/openai.toml:/etc/idemgate/idemgate.toml:ro \
#     -e OPENAI_API_KEY -e OPENROUTER_API_KEY -e IDEMGATE_ADMIN_TOKEN idemgate
#
# Inside a container the config must listen on 0.0.0.0 (listen = "0.0.0.0:8080").

FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
COPY tests ./tests
COPY config ./config
RUN cargo build --release --locked --bin idemgate

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
# The embedded store writes here; mount a volume to keep jobs across container restarts.
WORKDIR /var/lib/idemgate
ENV IDEMGATE_CONFIG=/etc/idemgate/idemgate.toml
EXPOSE 8080 8081
USER nonroot
ENTRYPOINT ["/usr/local/bin/idemgate"]
